"""ClusterView: what the Conductor knows about the cluster, folded from facts.

One `apply(fact, now)` entry point; no I/O and no clock: `now` (seconds on any monotonic
scale the caller picks: simulated time in sim/, a monotonic clock in the worker) is an
argument. The same sequence of facts always gives the same view, so a decision can be
replayed.

What it holds:
- prefill instances: node (whose DRAM is the instance's local prefix cache), the FCFS queue
  of predicted prefill seconds (queued + the remainder of the running one);
- decode instances: the running batch (count, summed context) and the work reserved for
  them by admitted requests whose prefill has not finished;
- the global block index (`BlockIndex`) fed by store facts;
- the in-flight requests with the times the predicted-load admission policy needs;
- the output lengths and decode times of the latest finished requests (`finished`): how
  far a decoding request's KV still grows, and how long it will still decode.

The view itself is mutable (the block index holds millions of keys; copying it per fact
would be O(N)); the facts are frozen values, and readers get plain values back.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

from mooncake.core.block_index import BlockIndex
from mooncake.core.decode_forecast import FinishedDecodes
from mooncake.core.ttft_error import TtftErrors
from mooncake.hashing import DEFAULT_TENANT

# --- facts (what the worker derives from bus events; what the simulator emits) ----------------


@dataclass(frozen=True, slots=True)
class InstanceJoined:
    instance: str
    role: Literal["prefill", "decode"]
    node: str = ""  # defaults to the instance id (one instance per node, as in the paper)
    kv_capacity_tokens: int | None = None  # decode: KV the instance can hold; None = unbounded


@dataclass(frozen=True, slots=True)
class InstanceLeft:
    instance: str


@dataclass(frozen=True, slots=True)
class Assigned:
    """A request was admitted to (prefill, decode): queue its predicted work.

    Built from a Decision by `conductor.assignment` (the queue-time update of Algorithm 1)."""

    request_id: str
    prefill_instance: str
    decode_instance: str
    prompt_tokens: int
    predicted_prefill_s: float
    predicted_ttft_s: float
    cached_tokens: int = 0  # the prefix it reuses (what its prefill is predicted from)
    # Whether its TTFT is a sample of the cost model's error (`ttft_errors`): not while
    # the model rests on no measurement of the serving engine.
    sampled: bool = True
    # CPP: the other prefill instances of its group (stages 1..), each held for the whole
    # pipelined prefill from when the last of the group is free.
    stage_instances: tuple[str, ...] = ()
    tenant: str = DEFAULT_TENANT


@dataclass(frozen=True, slots=True)
class PrefillStarted:
    request_id: str


@dataclass(frozen=True, slots=True)
class PrefillFinished:
    request_id: str
    # How it ran, when the worker says (the online cost model's prefill sample): the
    # prompt, the tokens reused from cache, and the seconds the prefill took.
    prompt_tokens: int | None = None
    cached_tokens: int = 0
    seconds: float | None = None


@dataclass(frozen=True, slots=True)
class DecodeStarted:
    request_id: str


@dataclass(frozen=True, slots=True)
class DecodeFinished:
    request_id: str
    output_tokens: int | None = None  # tokens it generated, for the view's output forecast


@dataclass(frozen=True, slots=True)
class RequestDropped:
    """Rejected by a later stage, failed or cancelled: release whatever it held."""

    request_id: str


@dataclass(frozen=True, slots=True)
class DecodeLoadReported:
    """A decode instance's own count of its running batch (corrects drift): the batch and
    its summed context (what a step's cost depends on), and its KV pool: the whole capacity
    and the tokens' worth of pages it can hand out now (`kv_free_tokens`: free pages and
    cached blocks nobody holds; a prefix shared by several sequences is held once). `fits`
    measures against the free pages when they are reported. None leaves what the view has."""

    instance: str
    batch: int
    context_tokens: int
    kv_capacity_tokens: int | None = None
    kv_free_tokens: int | None = None
    # The decode steps since the previous report (the online cost model's decode sample):
    # how many, their mean seconds, and the mean batch and KV tokens they ran with.
    steps: int = 0
    step_s: float | None = None
    step_batch: float | None = None
    step_context_tokens: float | None = None


@dataclass(frozen=True, slots=True)
class EngineCalibrated:
    """An instance's engine timed at its start: (prompt, cached, seconds) prefills or
    (batch, context tokens, seconds) decode steps, by its role. For the cost model only."""

    instance: str
    role: Literal["prefill", "decode"]
    samples: tuple[tuple[float, float, float], ...]


@dataclass(frozen=True, slots=True)
class BlocksStored:
    node: str
    keys: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    node: str
    keys: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class NodeLost:
    node: str


Fact = (
    InstanceJoined
    | InstanceLeft
    | Assigned
    | PrefillStarted
    | PrefillFinished
    | DecodeStarted
    | DecodeFinished
    | RequestDropped
    | DecodeLoadReported
    | EngineCalibrated
    | BlocksStored
    | BlocksRemoved
    | NodeLost
)

# --- state -------------------------------------------------------------------------------------


@dataclass(slots=True)
class PrefillInstance:
    id: str
    node: str
    queued: dict[str, float] = field(default_factory=dict)  # request -> predicted s, FCFS
    queued_s: float = 0.0
    running: str | None = None
    running_ends_at: float = 0.0

    def queue_s(self, now: float) -> float:
        """Predicted seconds of work ahead of a new request (T_queue of Algorithm 1)."""
        rest = self.running_ends_at - now if self.running is not None else 0.0
        return max(self.queued_s, 0.0) + max(rest, 0.0)


@dataclass(slots=True)
class DecodeInstance:
    id: str
    node: str
    kv_capacity_tokens: int | None = None
    batch: int = 0
    context_tokens: int = 0
    reserved_batch: int = 0
    reserved_tokens: int = 0
    # The pool's free KV as of the last report, less what started decoding since (None: the
    # instance reports none; its capacity less its context is used instead).
    kv_free_tokens: int | None = None

    def kv_room(self) -> int | None:
        """KV tokens the instance can give a request now, before the ones reserved for
        admitted requests still in prefill; None when unbounded."""
        if self.kv_capacity_tokens is None:
            return None
        if self.kv_free_tokens is not None:
            return self.kv_free_tokens
        return self.kv_capacity_tokens - self.context_tokens

    def fits(self, tokens: int) -> bool:
        """Room for `tokens` more on top of every admitted request routed here."""
        room = self.kv_room()
        return room is None or self.reserved_tokens + tokens <= room

    def could_hold(self, tokens: int) -> bool:
        """Could the whole pool hold a request of `tokens` (once others have left)?"""
        return self.kv_capacity_tokens is None or tokens < self.kv_capacity_tokens


@dataclass(slots=True)
class Inflight:
    """An admitted request, with the times the `predicted` admission policy needs."""

    request_id: str
    prefill_instance: str
    decode_instance: str
    context_tokens: int
    predicted_prefill_s: float
    prefill_done_at: float  # predicted until PrefillFinished, then actual
    phase: Literal["queued", "prefilling", "prefilled", "decoding"] = "queued"
    decode_started_at: float | None = None
    cached_tokens: int = 0
    admitted_at: float = 0.0
    predicted_ttft_s: float = 0.0  # at admission, moved by refits (the error's denominator)
    sampled: bool = True
    stage_instances: tuple[str, ...] = ()  # CPP: the group's other prefill instances
    tenant: str = DEFAULT_TENANT
    checked_at: float | None = None  # when the sweep last found it still running

    @property
    def seen_at(self) -> float:
        """Since when it is known to run: its admission, or the sweep's last look."""
        return self.admitted_at if self.checked_at is None else self.checked_at

    @property
    def prefill_group(self) -> tuple[str, ...]:
        return (self.prefill_instance, *self.stage_instances)


def _judged_by(r: Inflight) -> None:
    """A request's predicted TTFT after its predicted prefill end moved (`reestimate`): from
    its admission to that end (what it was at admission), never under its own prefill."""
    r.predicted_ttft_s = max(r.prefill_done_at - r.admitted_at, r.predicted_prefill_s)


class ClusterView:
    def __init__(self, max_index_keys: int | None = None) -> None:
        """`max_index_keys`: the most keys each of its two KV indexes holds (BlockIndex)."""
        self.prefill: dict[str, PrefillInstance] = {}
        self.decode: dict[str, DecodeInstance] = {}
        self.blocks = BlockIndex(max_index_keys)
        # Each engine's own KV pool (its engine tier), by instance id: local to that instance,
        # fetchable by no other, so kept out of `blocks` (the pool Algorithm 1 fetches from).
        self.engine_blocks = BlockIndex(max_index_keys)
        # Nodes (pool) and instances (engine tiers) whose index is not EXACT right now
        # (store/kv_index.py): their blocks count as not there, never as hits.
        self.unsure_nodes: frozenset[str] = frozenset()
        self.unsure_instances: frozenset[str] = frozenset()
        self.inflight: dict[str, Inflight] = {}
        # Requests in flight per tenant: with fewer than two tenants no share can bind, and
        # the per-tenant work (`tenant_prefill_work`, a walk of `inflight`) is not summed.
        self.tenants_inflight: dict[str, int] = {}
        # The latest finished requests' outputs and decode times (core/decode_forecast.py).
        self.finished = FinishedDecodes()
        # Observed / predicted TTFT of the latest prefills (core/ttft_error.py).
        self.ttft_errors = TtftErrors()
        # Sorted ids: iteration (and so tie-breaking) does not depend on join order.
        self.prefill_order: tuple[PrefillInstance, ...] = ()
        self.decode_order: tuple[DecodeInstance, ...] = ()

    @property
    def expected_output_tokens(self) -> float:
        """Mean output of the latest finished requests (0 before any)."""
        return self.finished.mean_output

    def local_blocks(self, keys: Sequence[str], p: PrefillInstance, in_dram: int) -> int:
        """Leading blocks of `keys` instance `p` holds itself, in its node's DRAM (`in_dram`,
        from the pool's match) or its engine's pool: what it needs no transfer for."""
        engine = self.engine_blocks
        if not len(engine) or p.id in self.unsure_instances:
            return in_dram
        node_sure = p.node not in self.unsure_nodes
        n = 0
        for key in keys:
            if p.id not in engine.holders(key) and not (
                node_sure and p.node in self.blocks.holders(key)
            ):
                break
            n += 1
        return max(n, in_dram)

    def local_ssd_blocks(self, keys: Sequence[str], p: PrefillInstance, local: int) -> int:
        """Of the `local` leading blocks `p` holds itself, those its node keeps only on SSD
        (and its engine's pool not at all): reading them costs the SSD's time."""
        blocks = self.blocks
        if not blocks.has_ssd or local <= 0:
            return 0
        engine = self.engine_blocks
        use_engine = len(engine) > 0 and p.id not in self.unsure_instances
        n = 0
        for key in keys[:local]:
            if p.node in blocks.ssd_holders(key) and not (
                use_engine and p.id in engine.holders(key)
            ):
                n += 1
        return n

    def tenant_prefill_work(self) -> dict[str, float]:
        """Predicted prefill seconds in flight (queued or running) per tenant, a group's
        counted once per member (core/tenancy.py)."""
        out: dict[str, float] = {}
        for r in self.inflight.values():
            if r.phase in ("queued", "prefilling"):
                held = r.predicted_prefill_s * len(r.prefill_group)
                out[r.tenant] = out.get(r.tenant, 0.0) + held
        return out

    def prefill_instances(self) -> Iterator[PrefillInstance]:
        return iter(self.prefill_order)

    def decode_instances(self) -> Iterator[DecodeInstance]:
        return iter(self.decode_order)

    def unchecked(self, before: float, limit: int) -> list[str]:
        """Up to `limit` in-flight requests not known to run since `before` (admitted, or last
        checked, earlier), the longest unknown first: what the Conductor's sweep asks the
        terminal slots about (serving/conductor_sweep.py). Each is asked once per sweep
        period, not on every sweep, however long it runs."""
        old = (r for r in self.inflight.values() if r.seen_at < before)
        return [r.request_id for r in heapq.nsmallest(limit, old, key=lambda r: r.seen_at)]

    def still_running(self, request_ids: Sequence[str], now: float) -> None:
        """The sweep found these running at `now` (their terminal slots are empty)."""
        for rid in request_ids:
            if (r := self.inflight.get(rid)) is not None:
                r.checked_at = now

    def bound_to(self, instance: str) -> list[str]:
        """In-flight requests that name `instance` (as prefill or decode): work for them may
        still be sent to its subject, by the Conductor or by the prefill that hands over."""
        return [
            r.request_id
            for r in self.inflight.values()
            if instance == r.decode_instance or instance in r.prefill_group
        ]

    def apply(self, fact: Fact, now: float) -> None:
        match fact:
            case InstanceJoined():
                self._join(fact)
            case InstanceLeft(instance=iid):
                self.prefill.pop(iid, None)
                self.decode.pop(iid, None)
                self.engine_blocks.drop_node(iid)
                self._reorder()
            case Assigned():
                self._assigned(fact, now)
            case PrefillStarted(request_id=rid):
                self._prefill_started(rid, now)
            case PrefillFinished(request_id=rid):
                self._prefill_finished(rid, now)
            case DecodeStarted(request_id=rid):
                self._decode_started(rid, now)
            case DecodeFinished(request_id=rid, output_tokens=n):
                if (r := self.inflight.get(rid)) is not None:  # else: redelivered
                    began = r.decode_started_at
                    self.finished.add(n, None if began is None else now - began)
                self._release(rid)
            case RequestDropped(request_id=rid):
                self._release(rid)
            case DecodeLoadReported(instance=iid, batch=b, context_tokens=c):
                if (d := self.decode.get(iid)) is not None:
                    d.batch, d.context_tokens = b, c
                    if fact.kv_capacity_tokens is not None:
                        d.kv_capacity_tokens = fact.kv_capacity_tokens
                    if fact.kv_free_tokens is not None:
                        d.kv_free_tokens = fact.kv_free_tokens
            case BlocksStored(node=node, keys=keys):
                self.blocks.add(node, keys)
            case BlocksRemoved(node=node, keys=keys):
                self.blocks.remove(node, keys)
            case NodeLost(node=node):
                self.blocks.drop_node(node)

    def _join(self, f: InstanceJoined) -> None:
        node = f.node or f.instance
        if f.role == "prefill":
            self.prefill.setdefault(f.instance, PrefillInstance(f.instance, node))
        else:
            self.decode.setdefault(
                f.instance, DecodeInstance(f.instance, node, f.kv_capacity_tokens)
            )
        self._reorder()

    def _reorder(self) -> None:
        self.prefill_order = tuple(self.prefill[k] for k in sorted(self.prefill))
        self.decode_order = tuple(self.decode[k] for k in sorted(self.decode))

    def _assigned(self, f: Assigned, now: float) -> None:
        group = [self.prefill.get(i) for i in (f.prefill_instance, *f.stage_instances)]
        d = self.decode.get(f.decode_instance)
        if None in group or d is None or f.request_id in self.inflight:
            return  # an instance left meanwhile, or a redelivered fact: nothing to add
        # A group starts when the last of it is free: each member's queue grows by its wait
        # for that moment and the prefill (one instance: by the prefill).
        start = max(p.queue_s(now) for p in group if p is not None)
        for p in group:
            assert p is not None
            held = start - p.queue_s(now) + f.predicted_prefill_s
            p.queued[f.request_id] = held
            p.queued_s += held
        d.reserved_batch += 1
        d.reserved_tokens += f.prompt_tokens
        self.inflight[f.request_id] = Inflight(
            f.request_id,
            f.prefill_instance,
            f.decode_instance,
            f.prompt_tokens,
            f.predicted_prefill_s,
            now + f.predicted_ttft_s,
            cached_tokens=f.cached_tokens,
            admitted_at=now,
            predicted_ttft_s=f.predicted_ttft_s,
            sampled=f.sampled,
            stage_instances=f.stage_instances,
            tenant=f.tenant,
        )
        self.tenants_inflight[f.tenant] = self.tenants_inflight.get(f.tenant, 0) + 1

    def _dequeue(self, r: Inflight) -> list[PrefillInstance]:
        """Take `r` off the queue of every instance of its prefill group; those still here."""
        out = []
        for iid in r.prefill_group:
            p = self.prefill.get(iid)
            if p is None:
                continue
            out.append(p)
            if r.request_id in p.queued:
                p.queued_s -= p.queued.pop(r.request_id)
                if not p.queued:
                    p.queued_s = 0.0  # no float drift accumulates across an idle period
        return out

    def _prefill_started(self, rid: str, now: float) -> None:
        r = self.inflight.get(rid)
        if r is None or r.phase != "queued":
            return
        group = self._dequeue(r)
        r.phase = "prefilling"
        for p in group:
            p.running, p.running_ends_at = rid, now + r.predicted_prefill_s
        if group:
            r.prefill_done_at = now + r.predicted_prefill_s

    def _end_prefill(self, r: Inflight) -> None:
        for p in self._dequeue(r):
            if p.running == r.request_id:
                p.running = None

    def _prefill_finished(self, rid: str, now: float) -> None:
        r = self.inflight.get(rid)
        if r is None or r.phase not in ("queued", "prefilling"):
            return
        self._end_prefill(r)
        r.phase, r.prefill_done_at = "prefilled", now
        if r.sampled:
            # A group's (CPP) pipelined prefill is not one instance's price: not rescaled.
            own = 0.0 if r.stage_instances else r.predicted_prefill_s
            self.ttft_errors.add(now - r.admitted_at, r.predicted_ttft_s, r.context_tokens,
                                 r.cached_tokens, own)  # fmt: skip

    def reestimate(self, prefill_s: Callable[[int, int], float], now: float) -> None:
        """The cost model changed: predict every queued and running prefill again with
        `prefill_s(prompt, cached)`, so the queue a new request waits behind is the new
        model's, not the sum of whatever each queued request was admitted with. A queued
        request's predicted prefill end moves by the change of everything ahead of it on
        its instance and of its own prefill (the queue is FCFS), and so does the TTFT it is
        judged against when it ends (`ttft_errors`, whose samples are rescaled too). A
        group's (CPP) pipelined prefill keeps its prediction: `prefill_s` prices one
        instance's."""
        self.ttft_errors.rescale(prefill_s)
        for p in self.prefill_order:
            shift = 0.0
            r = self.inflight.get(p.running) if p.running is not None else None
            if r is not None and not r.stage_instances:
                new = prefill_s(r.context_tokens, r.cached_tokens)
                shift = new - r.predicted_prefill_s
                r.predicted_prefill_s = new
                p.running_ends_at += shift
                r.prefill_done_at = p.running_ends_at
                _judged_by(r)
            total = 0.0
            for rid in p.queued:
                q = self.inflight.get(rid)
                if q is None or q.stage_instances:
                    total += p.queued[rid]
                    continue
                new = prefill_s(q.context_tokens, q.cached_tokens)
                shift += new - q.predicted_prefill_s
                q.predicted_prefill_s = p.queued[rid] = new
                q.prefill_done_at = max(q.prefill_done_at + shift, now)
                _judged_by(q)
                total += new
            p.queued_s = total

    def _decode_started(self, rid: str, now: float) -> None:
        r = self.inflight.get(rid)
        if r is None or r.phase == "decoding":
            return
        if r.phase in ("queued", "prefilling"):
            self._prefill_finished(rid, now)
        d = self.decode.get(r.decode_instance)
        if d is not None:
            d.reserved_batch -= 1
            d.reserved_tokens -= r.context_tokens
            d.batch += 1
            d.context_tokens += r.context_tokens
            if d.kv_free_tokens is not None:  # its pages until the next report says
                d.kv_free_tokens = max(d.kv_free_tokens - r.context_tokens, 0)
        r.phase, r.decode_started_at = "decoding", now

    def _release(self, rid: str) -> None:
        r = self.inflight.pop(rid, None)
        if r is None:
            return
        left = self.tenants_inflight.get(r.tenant, 0) - 1
        if left > 0:
            self.tenants_inflight[r.tenant] = left
        else:
            self.tenants_inflight.pop(r.tenant, None)
        self._end_prefill(r)
        d = self.decode.get(r.decode_instance)
        if d is None:
            return
        if r.phase == "decoding":
            d.batch = max(d.batch - 1, 0)
            d.context_tokens = max(d.context_tokens - r.context_tokens, 0)
            if d.kv_free_tokens is not None and d.kv_capacity_tokens is not None:
                d.kv_free_tokens = min(d.kv_free_tokens + r.context_tokens, d.kv_capacity_tokens)
        else:
            d.reserved_batch -= 1
            d.reserved_tokens -= r.context_tokens

"""The Conductor's ClusterView, fed live from the bus.

Three signals, none of them durable (they are hints for prediction; the durable record is
the recorder's job):
- load reports (`mc.load.<instance>`, core NATS): the first report of an instance is its
  `InstanceJoined`; a decode instance's report corrects its batch (`DecodeLoadReported`);
  silence longer than the liveness timeout is `InstanceLeft` (+ `NodeLost` when no live
  instance is left on its node, since a worker's store node lives in its process);
- the KV index (`mc.kv.events.<node>`): `KvIndexSubscriber` follows every node straight into
  the view's `BlockIndex`, and every engine's pool (`mc.kv.engine.<instance>`, that
  instance's engine tier) into `engine_blocks`;
- lifecycle events of admitted requests (`mc.req.*`, a core subscription): the facts that
  move a request through the view's queues (`PrefillStarted`, `PrefillFinished`, ...).

It also answers `mc.kv.index.state` (request/reply): the state of every KV index it follows
and since when (`index_report`; `mooncake up`'s status table asks).

`Liveness`, `lifecycle_fact` are pure (time is an argument); `LiveFeed` does the I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pydantic import ValidationError

from mooncake import events as ev
from mooncake import metrics
from mooncake.aio import cancel_all
from mooncake.core import cluster as cl
from mooncake.store import protocol as sp
from mooncake.store.kv_follow import KvIndexSubscriber
from mooncake.store.kv_index import IndexState, KvIndexFollower
from mooncake.work import LoadReport, WorkSubjects

log = logging.getLogger("mooncake.conductor.feed")

Role = Literal["prefill", "decode"]


@dataclass(slots=True)
class Member:
    instance: str
    role: Role
    node: str
    last_seen: float
    seq: int = 0
    calibrated: bool = False  # its engine timings have been passed on


class Liveness:
    """Which instances are alive, from their load reports. Pure: `now` is an argument."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.members: dict[str, Member] = {}

    def report(self, r: LoadReport, now: float) -> list[cl.Fact]:
        """The facts one report adds to the view (a first report is a join)."""
        facts: list[cl.Fact] = []
        m = self.members.get(r.instance)
        if m is not None and (m.role != r.role or m.node != r.node):
            # The id came back as something else (a restart with another role or node).
            facts.extend(self._left(self.members.pop(r.instance)))
            m = None
        if m is None:
            facts.append(cl.InstanceJoined(r.instance, r.role, r.node, r.kv_capacity_tokens))
            m = self.members[r.instance] = Member(r.instance, r.role, r.node, now)
        m.last_seen, m.seq = now, r.seq
        if r.calibration and not m.calibrated:
            m.calibrated = True
            timed = tuple((float(t.x), float(t.z), t.seconds) for t in r.calibration)
            facts.append(cl.EngineCalibrated(r.instance, r.role, timed))
        if r.role == "decode":
            free, cap = r.kv_free_tokens, r.kv_capacity_tokens
            steps = (r.steps, r.step_s, r.step_batch, r.step_context_tokens)
            facts.append(
                cl.DecodeLoadReported(r.instance, r.running, r.context_tokens, cap, free, *steps)
            )
        return facts

    def expire(self, now: float) -> list[tuple[Member, list[cl.Fact]]]:
        """Instances silent for longer than the timeout, each with the facts of its death."""
        dead = [m for m in self.members.values() if now - m.last_seen > self.timeout_s]
        out: list[tuple[Member, list[cl.Fact]]] = []
        for m in sorted(dead, key=lambda m: m.instance):
            del self.members[m.instance]
            out.append((m, self._left(m)))
        return out

    def _left(self, m: Member) -> list[cl.Fact]:
        facts: list[cl.Fact] = [cl.InstanceLeft(m.instance)]
        if not any(o.node == m.node for o in self.members.values() if o.instance != m.instance):
            facts.append(cl.NodeLost(m.node))
        return facts

    def alive(self, role: Role) -> list[str]:
        return sorted(m.instance for m in self.members.values() if m.role == role)


# Lifecycle events the view follows, and the fact each one is.
LIFECYCLE: tuple[type[ev.RequestEvent], ...] = (
    ev.PrefillStarted,
    ev.RequestPrefilled,
    ev.DecodeStarted,
    ev.RequestCompleted,
    ev.RequestFailed,
    ev.RequestCancelled,
    ev.RequestRejected,
)


def lifecycle_fact(event: ev.Event) -> cl.Fact | None:
    match event:
        case ev.PrefillStarted(request_id=rid):
            return cl.PrefillStarted(rid)
        case ev.RequestPrefilled(request_id=rid, prompt_tokens=n, cached_tokens=c, prefill_s=t):
            # A CPP group's time (or a group's given up, then one instance's) is no sample of
            # what one instance takes: the cost model prices one instance.
            one = t > 0 and not event.stages and event.cpp_fallback is None
            return cl.PrefillFinished(rid, n, c, t if one else None)
        case ev.DecodeStarted(request_id=rid):
            return cl.DecodeStarted(rid)
        case ev.RequestCompleted(request_id=rid, output_tokens=n):
            return cl.DecodeFinished(rid, n)
        case (
            ev.RequestFailed(request_id=rid)
            | ev.RequestCancelled(request_id=rid)
            | ev.RequestRejected(request_id=rid)
        ):
            return cl.RequestDropped(rid)
    return None


States = Mapping[str, tuple[IndexState, float]]  # node -> (state, since: unix seconds)


def index_report(nodes: States, engines: States, at: float) -> sp.KvIndexReport:
    """What the Conductor answers on `mc.kv.index.state` (`KvIndexSubscriber.states` of
    the store nodes and of the engines, as of `at`)."""

    def wire(states: States) -> list[sp.KvIndexNodeState]:
        return [
            sp.KvIndexNodeState(node_id=n, state=state, since=since)
            for n, (state, since) in sorted(states.items())
        ]

    return sp.KvIndexReport(at=at, nodes=wire(nodes), engines=wire(engines))


OnDead = Callable[[Member], Awaitable[None]]
OnFact = Callable[[cl.Fact], None]


class LiveFeed:
    """Subscriptions and the liveness ticker that keep one ClusterView current."""

    def __init__(
        self,
        nc: NATS,
        ns: ev.Namespace,
        view: cl.ClusterView,
        liveness: Liveness,
        *,
        on_dead: OnDead,
        on_fact: OnFact | None = None,
        tick_s: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.nc, self.ns, self.view, self.liveness = nc, ns, view, liveness
        self.follower = KvIndexFollower(view.blocks)
        self.kv = KvIndexSubscriber(nc, ns, self.follower, on_state=self._index_state)
        self.engine_follower = KvIndexFollower(view.engine_blocks)
        self.engine_kv = KvIndexSubscriber(
            nc, ns, self.engine_follower, engine=True, on_state=self._index_state
        )
        self._on_dead, self._on_fact = on_dead, on_fact
        self._tick_s, self._clock = tick_s, clock
        self._subs: list[Subscription] = []
        self._ticker: asyncio.Task[None] | None = None
        self._subject_type = {ns.of(c): c for c in LIFECYCLE}

    def apply(self, fact: cl.Fact) -> None:
        if isinstance(fact, cl.NodeLost):
            # The node's blocks go, and so does its KV event stream: its next life (or a
            # node that only looked dead) is re-read from a snapshot, not from deltas.
            self.kv.drop_node(fact.node)
            self._index_state()
        else:
            if isinstance(fact, cl.InstanceLeft):  # its engine tier dies with it
                self.engine_kv.drop_node(fact.instance)
                self._index_state()
            self.view.apply(fact, self._clock())
        if self._on_fact is not None:
            self._on_fact(fact)

    def _index_state(self) -> None:
        """A node's KV index changed state: what the Conductor counts as unknown, and the
        metric (nodes per state, pool and engine tiers together)."""
        self.view.unsure_nodes = self.follower.unsure()
        self.view.unsure_instances = self.engine_follower.unsure()
        counts = dict.fromkeys(IndexState, 0)
        for f in (self.follower, self.engine_follower):
            for state in f.states().values():
                counts[state] += 1
        for state, n in counts.items():
            metrics.KV_INDEX_NODES.labels(state.value).set(n)

    async def start(self) -> None:
        await self.kv.start()
        await self.engine_kv.start()
        self._subs.append(
            await self.nc.subscribe(WorkSubjects(self.ns).load("*"), cb=self._on_report)
        )
        for subject in self._subject_type:
            self._subs.append(await self.nc.subscribe(subject, cb=self._on_lifecycle))
        asks = self.kv.subjects.kv_index_state()
        self._subs.append(await self.nc.subscribe(asks, cb=self._on_index_ask))
        await self.nc.flush()
        self._ticker = asyncio.create_task(self._tick())

    async def stop(self) -> None:
        if self._ticker is not None:
            await cancel_all([self._ticker])
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        await self.kv.stop()
        await self.engine_kv.stop()

    async def _on_report(self, msg: Msg) -> None:
        try:
            r = LoadReport.model_validate_json(msg.data)
        except ValidationError:
            log.warning("unreadable load report on %s ignored", msg.subject)
            return
        for fact in self.liveness.report(r, self._clock()):
            self.apply(fact)
        metrics.INSTANCE_QUEUE_DEPTH.labels(r.instance, r.role).set(r.queued)
        metrics.INSTANCE_RUNNING.labels(r.instance, r.role).set(r.running)

    async def _on_index_ask(self, msg: Msg) -> None:
        if not msg.reply:
            return
        report = index_report(self.kv.states, self.engine_kv.states, time.time())
        with contextlib.suppress(Exception):  # the asker may be gone: best effort
            await msg.respond(report.model_dump_json().encode())

    async def _on_lifecycle(self, msg: Msg) -> None:
        event = ev.parse_event(msg.data, subject=self.ns.canonical(msg.subject))
        if isinstance(event, ev.InvalidEvent):
            return
        fact = lifecycle_fact(event)
        if fact is not None:
            self.apply(fact)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self._tick_s)
            try:
                await self.expire()
            except Exception:  # the ticker must outlive any one failure
                log.exception("liveness check failed")

    async def expire(self) -> None:
        for member, facts in self.liveness.expire(self._clock()):
            log.warning(
                "%s instance %s silent for over %.1fs: declared dead",
                member.role, member.instance, self.liveness.timeout_s,
            )  # fmt: skip
            for fact in facts:
                self.apply(fact)
            for gauge in (metrics.INSTANCE_QUEUE_DEPTH, metrics.INSTANCE_RUNNING):
                with contextlib.suppress(KeyError):
                    gauge.remove(member.instance, member.role)
            metrics.INSTANCES_DECLARED_DEAD.labels(member.role).inc()
            await self._on_dead(member)

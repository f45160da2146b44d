"""The Conductor's KVCache-centric scheduling: Algorithm 1 of FAST'25 (PAPER.md §3).

```
best_len = longest cached prefix anywhere in the pool
for each prefill instance p:
    if best_len / p.local_prefix_len > balancing_threshold:  prefix = best_len,
        T_transfer = transfer_time(best_len - p.local_prefix_len)
    else:  prefix = p.local_prefix_len,  T_transfer = 0
    TTFT(p) = T_transfer + T_queue(p) + T_prefill(prompt_len, prefix)
choose p with the least TTFT; choose d by load, with its predicted TBT
if TTFT > TTFT_SLO or TBT > TBT_SLO: reject
if p takes the remote prefix: p keeps a copy (hot blocks replicate)
```

`choose` runs the loop and returns a `Choice`; `decide` adds the SLO check and returns a
`Decision` (a frozen value with every input that drove it, `to_dict()` for the event log);
`assignment` turns an admitted Decision into the `Assigned` fact that updates the chosen
instance's queue. Pure: the view is read, never changed; time is the `now` argument.

The balancing threshold, and the one place this departs from the pseudo-code: taken
literally, the threshold is a switch that can make a *longer* local prefix look slower (pool
10 blocks: with 2 local blocks an instance is past the threshold and fetches 8 cheap blocks;
with 6 it is not, and recomputes 4 expensive ones). A scheduler that ranks instances by a
TTFT that grows with what they already hold steers work away from its own cache. The law
"a longer local prefix never looks slower" together with the paper's rule at local = 0 (an
instance with nothing takes the pool's prefix) forces fetching to be an option for *every*
instance: one holding more can always do what one holding less does, and fetching the
missing rest is never dearer than fetching more. So:
- past the threshold (`best > threshold * local`): fetch, as the paper says, even where
  recomputing would be a little faster - this is its deliberate hot-block replication;
- otherwise: fetch the missing blocks only if that is strictly faster than recomputing them.
Both branches' TTFTs fall as the local prefix grows, and crossing the threshold only moves
an instance from "must fetch" to "the cheaper of fetch and recompute", so the law holds for
any cost model whose transfer time grows with bytes and whose prefill time falls with the
cached prefix (tests/unit/test_conductor.py checks it with hypothesis). Whenever the chosen
instance takes a remote prefix it keeps a copy (`CopyBlocks`), as in the paper. On the
reference hardware fetching a block is 5-11x cheaper than recomputing it, so every instance
takes the pool's prefix and the threshold only matters on slow networks. `pool_fetch=False` turns
the pool off (each instance reuses only its own cache: the local-cache baselines of
FAST'25 Fig. 5 / 10).

Readings of the pseudo-code (documented because the paper leaves them open):
- `best_len / local > threshold` is evaluated as `best_len > threshold * local`, so a node
  with no local prefix is past any threshold (x/0 = ∞); nothing is fetched when the pool's
  prefix is no longer than the local one.
- Block counts become tokens as `min(blocks * block_tokens, prompt_tokens)`.
- The paper assumes reuse always pays (on its hardware it does). Not on every engine: a
  small model on a GPU prefilled a mostly cached prompt slower than from scratch (the issue
  "Engine speed"). So a prefix, local or fetched, is cut to the whole blocks worth loading
  (`cost_model.reuse`: by the cost model, loading them and computing the rest is
  faster than computing more), down to none; the TTFT is that choice's, and the decision
  carries the cut (`load_limit_blocks`) to the prefill, which otherwise loads every block
  the store holds. Cost models without a loading cost never cut.
- "d by load": the decode instance whose step time is least with the work already routed
  to it (running + reserved + this request), so a burst does not herd onto one instance;
  among those with KV room for the prompt (free pages less what is reserved), else among
  those whose pool can hold it at all (the instance queues it until pages are free);
  its predicted TBT (checked against the SLO) is the step time of its *current* batch plus
  this request, each member grown by the expected output (`batch_tbt_s`) - the decode load
  on arrival, as the early-rejection policy of PAPER.md §5 defines it (work routed there
  and still in prefill is not counted: that blind spot is what the paper's prediction-based
  policy fixes). Ties go to the smallest instance id (determinism).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from functools import lru_cache
from typing import Any

from mooncake.core.block_index import PrefixMatch
from mooncake.core.cluster import Assigned, ClusterView, DecodeInstance, PrefillInstance
from mooncake.core.cost_model import Costs, reuse
from mooncake.core.cpp import CppConfig, CppGroup, choose_group
from mooncake.core.tenancy import TenantShares
from mooncake.events import RejectReason
from mooncake.hashing import DEFAULT_TENANT


@dataclass(frozen=True, slots=True)
class ConductorConfig:
    block_tokens: int = 512
    # Take the pool's prefix whenever it is this many times longer than the local one (hot
    # blocks replicate); below that, only when fetching it beats recomputing it.
    balancing_threshold: float = 2.0
    # False: no global pool; an instance reuses only its own cache.
    pool_fetch: bool = True
    ttft_slo_s: float = 30.0
    tbt_slo_s: float = 0.1
    # `predicted` admission: the uniform decode time t_d every request is assumed to take.
    uniform_decode_s: float = 10.0
    # Rejecting policies judge predicted TTFT x this quantile of observed / predicted TTFT
    # of the latest requests (core/ttft_error.py); None judges the prediction as it is.
    ttft_margin_quantile: float | None = 0.9
    # Chunked pipeline parallelism (core/cpp.py): when a prefill runs on a group of
    # instances; the default (max_stages 1) never groups.
    cpp: CppConfig = field(default_factory=CppConfig)
    # Per-tenant admission shares under contention (core/tenancy.py).
    tenants: TenantShares = field(default_factory=TenantShares)
    # Admitted requests in flight at most (`in_flight_limit` past it): the Conductor's state
    # for them is what bounds its memory.
    max_inflight: int = 100_000


@dataclass(frozen=True, slots=True)
class ScheduleRequest:
    request_id: str
    prompt_tokens: int
    keys: tuple[str, ...]  # chained block keys of the prompt's whole blocks
    tenant: str = DEFAULT_TENANT


@dataclass(frozen=True, slots=True)
class CopyBlocks:
    """Hot-block replication: `target_node` keeps a copy of `keys` it fetches for a prefill.

    `sources` are nodes holding every key; empty means the blocks are spread over nodes."""

    target_node: str
    keys: tuple[str, ...]
    sources: tuple[str, ...]


# (instance, local_blocks, prefix_blocks, transfer_s, queue_s, ttft_s); transfer_s is the
# prefix's loading: the fetch from the pool and the reads of blocks held only on SSD.
PrefillCandidate = tuple[str, int, int, float, float, float]
# (instance, batch, context_tokens, reserved_batch, reserved_tokens, committed_tbt_s)
DecodeCandidate = tuple[str, int, int, int, int, float]


@dataclass(frozen=True, slots=True)
class Choice:
    """Algorithm 1 before the SLO check: the least-TTFT prefill and least-loaded decode."""

    request: ScheduleRequest
    now: float
    prefill: PrefillInstance
    decode: DecodeInstance
    local_blocks: int
    best_blocks: int
    prefix_blocks: int
    prefix_tokens: int
    transfer_s: float
    queue_s: float
    prefill_s: float
    ttft_s: float
    tbt_s: float
    copy: CopyBlocks | None
    candidates: tuple[PrefillCandidate, ...]
    decode_candidates: tuple[DecodeCandidate, ...]
    # CPP: the group's other prefill instances, stages 1.. (`prefill` is stage 0); queue_s
    # is then when the last of them is free and prefill_s the pipeline's.
    stage_instances: tuple[str, ...] = ()
    # Of the prefix's blocks, those read from an SSD (held nowhere reachable in DRAM).
    ssd_blocks: int = 0
    # Where the cost model judged loading more of the cached prefix than `prefix_blocks`
    # slower than computing it (`_Reuse`): the blocks the prefill may load at most.
    load_limit_blocks: int | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    request_id: str
    policy: str
    admitted: bool
    reason: RejectReason | None
    now: float
    prompt_tokens: int
    stage: str = "admission"
    prefill_instance: str | None = None
    decode_instance: str | None = None
    local_prefix_blocks: int = 0
    remote_prefix_blocks: int = 0  # longest prefix anywhere in the pool
    prefix_tokens: int = 0  # tokens the chosen instance reuses (local or fetched)
    takes_remote: bool = False
    transfer_s: float = 0.0
    queue_s: float = 0.0
    prefill_s: float = 0.0
    predicted_ttft_s: float | None = None
    predicted_tbt_s: float | None = None
    prefill_load: float | None = None
    decode_load: float | None = None
    copy: CopyBlocks | None = None
    config: ConductorConfig = field(default_factory=ConductorConfig)
    candidates: tuple[PrefillCandidate, ...] = ()
    decode_candidates: tuple[DecodeCandidate, ...] = ()
    # Policy-specific inputs (e.g. the predicted per-instance decode loads), name -> number.
    extra: tuple[tuple[str, float], ...] = ()
    # CPP: the prefill group's stages after `prefill_instance` (stage 0); () = one instance.
    stage_instances: tuple[str, ...] = ()
    tenant: str = DEFAULT_TENANT
    # Of the prefix's blocks, those the index said are held only on SSD (charged the SSD
    # read in transfer_s).
    ssd_prefix_blocks: int = 0
    # Set where the cost model judged loading more of the cached prefix than the blocks of
    # `prefix_tokens` slower than computing it: the prefill loads at most these (0: none,
    # the prefix is recomputed), whatever more the store holds by then. None: every block
    # the store holds (those stored since the decision too).
    load_limit_blocks: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable; what `RequestAdmitted.inputs` / `RequestRejected.inputs` hold.

        Built field by field (the Conductor calls it for every decision; `asdict`'s deep
        copy was a tenth of its time per request), with the same result as `asdict`."""
        d = {name: getattr(self, name) for name in _DECISION_FIELDS}
        d["config"] = _config_dict(self.config)
        d["reason"] = self.reason.value if self.reason is not None else None
        d["candidates"] = [list(c) for c in self.candidates]
        d["decode_candidates"] = [list(c) for c in self.decode_candidates]
        d["extra"] = dict(self.extra)
        d["stage_instances"] = list(self.stage_instances)
        if self.copy is not None:
            d["copy"] = {
                "target_node": self.copy.target_node,
                "keys": list(self.copy.keys),
                "sources": list(self.copy.sources),
            }
        return d


_DECISION_FIELDS = tuple(f.name for f in fields(Decision))


@lru_cache(maxsize=16)
def _config_dict_cached(config: ConductorConfig) -> dict[str, Any]:
    return asdict(config)


def _config_dict(config: ConductorConfig) -> dict[str, Any]:
    """The config as a dict: one Conductor decides under one config, so it is built once."""
    return dict(_config_dict_cached(config))


def prefix_tokens(blocks: int, prompt_tokens: int, block_tokens: int) -> int:
    return min(blocks * block_tokens, prompt_tokens)


def _prefill_candidates(
    view: ClusterView, req: ScheduleRequest, cfg: ConductorConfig, costs: Costs, now: float
) -> tuple[PrefixMatch, tuple[PrefillCandidate, ...], dict[str, int], _Reuse]:
    """The match, each prefill instance's candidate row, how many of the blocks each would
    load come from an SSD, and the reuse memo its options were priced with."""
    match = view.blocks.match(req.keys, view.unsure_nodes)
    best = match.best_blocks
    node_blocks = match.node_blocks
    prompt = req.prompt_tokens
    # Memo per (local prefix, of it on SSD): few distinct values among many instances; and
    # per prefix length, what of it is worth loading (`_Reuse`).
    option_of: dict[tuple[int, int], tuple[int, float, float, int]] = {}
    worth = _Reuse(prompt, cfg.block_tokens, costs)
    out: list[PrefillCandidate] = []
    ssd_of: dict[str, int] = {}
    for p in view.prefill_order:
        local = view.local_blocks(req.keys, p, node_blocks.get(p.node, 0))
        local_ssd = view.local_ssd_blocks(req.keys, p, local)
        option = option_of.get((local, local_ssd))
        if option is None:
            pool_ssd = view.blocks.pool_ssd_blocks(req.keys, local, best, view.unsure_nodes)
            option = option_of[(local, local_ssd)] = _prefix_option(
                local, best, cfg, costs, worth, local_ssd, pool_ssd
            )
        prefix, load, t_prefill, ssd_of[p.id] = option
        queue = p.queue_s(now)
        out.append((p.id, local, prefix, load, queue, load + queue + t_prefill))
    return match, tuple(out), ssd_of, worth


class _Reuse:
    """Of a prompt's first `blocks` cached blocks, those the cost model says to load and
    the prefill's predicted seconds so (`cost_model.reuse`), memoized for one decision."""

    def __init__(self, prompt: int, bt: int, costs: Costs) -> None:
        self.prompt, self.bt, self.costs = prompt, bt, costs
        self.memo: dict[int, tuple[int, float]] = {}

    def __call__(self, blocks: int) -> tuple[int, float]:
        got = self.memo.get(blocks)
        if got is None:
            tokens = prefix_tokens(blocks, self.prompt, self.bt)
            used, seconds = reuse(self.costs.prefill, self.prompt, tokens, self.bt)
            got = self.memo[blocks] = (blocks if used >= tokens else used // self.bt, seconds)
        return got


def _prefix_option(
    local: int,
    best: int,
    cfg: ConductorConfig,
    costs: Costs,
    worth: _Reuse,
    local_ssd: int = 0,
    pool_ssd: int = 0,
) -> tuple[int, float, float, int]:
    """(prefix blocks, load s, prefill s, blocks read from SSD) for an instance holding
    `local` blocks when the pool holds `best`: the threshold rule of the module docstring.
    Loading counts the transfer from the pool and the SSD reads of blocks held only on SSD
    (`local_ssd` of the local ones, `pool_ssd` of the pool's others). Of a prefix, only the
    blocks worth loading are taken (`cost_model.reuse`, memoized in `worth`): where the cost
    model says loading a cached block costs more than computing it saves, the prefix is
    shorter than what is held, down to none (recompute), and nothing past it is fetched."""
    bt, prompt = cfg.block_tokens, worth.prompt
    held, (local, recompute) = local, worth(local)
    local_ssd = min(local_ssd, local)  # where the SSD-only ones lie is not known: all loaded
    local_load = costs.ssd_s(prefix_tokens(local_ssd, prompt, bt))
    if not cfg.pool_fetch or best <= held:
        return local, local_load, recompute, local_ssd
    best, fetched = worth(best)
    if best <= held:
        return local, local_load, recompute, local_ssd
    pool_ssd = min(pool_ssd, best - held)
    transfer = costs.transfer.transfer_s(prefix_tokens(best - held, prompt, bt))
    load = transfer + costs.ssd_s(prefix_tokens(local_ssd + pool_ssd, prompt, bt))
    if best > cfg.balancing_threshold * held or load + fetched < local_load + recompute:
        return best, load, fetched, local_ssd + pool_ssd
    return local, local_load, recompute, local_ssd


def batch_tbt_s(view: ClusterView, costs: Costs, batch: int, context_tokens: int) -> float:
    """Predicted TBT of a decode batch of `batch` sequences whose KV is `context_tokens` now:
    the step once every member has grown by the output a request is expected to produce
    (`ClusterView.expected_output_tokens`, the mean of the latest finished ones).

    A request is scored by its slowest gaps (PAPER.md §7), which come late in its decode,
    when it and its batch have grown by their outputs; a step predicted from the KV at
    admission alone admits batches that drift over the SLO as they grow (the simulator's
    decode-bound run lost most of its goodput that way: batches admitted at 29 ms ran at
    30.3 ms against a 30 ms SLO)."""
    growth = batch * view.expected_output_tokens
    return costs.decode.decode_step_s(batch, int(context_tokens + growth))


def _decode_candidates(
    view: ClusterView, prompt_tokens: int, costs: Costs
) -> tuple[DecodeCandidate, ...]:
    """Decode instances with KV room for the prompt now; when none has, those whose pool can
    hold it at all: a paged decode instance keeps work it cannot hold yet on its queue (and
    preempts rather than fails), so a full pool delays a request, it does not turn it away.
    Rejecting for load is the admission policies' job."""
    roomy = [d for d in view.decode_order if d.fits(prompt_tokens)]
    pool = roomy or [d for d in view.decode_order if d.could_hold(prompt_tokens)]
    return tuple(
        (
            d.id,
            d.batch,
            d.context_tokens,
            d.reserved_batch,
            d.reserved_tokens,
            batch_tbt_s(
                view,
                costs,
                d.batch + d.reserved_batch + 1,
                d.context_tokens + d.reserved_tokens + prompt_tokens,
            ),
        )
        for d in pool
    )


def _argmin(rows: Sequence[tuple[Any, ...]], col: int) -> tuple[Any, ...]:
    """First row with the least value in `col`; rows come in instance-id order."""
    best = rows[0]
    for row in rows:
        if row[col] < best[col]:
            best = row
    return best


def choose_decode(view: ClusterView, prompt_tokens: int, costs: Costs) -> DecodeInstance | None:
    """Algorithm 1's "d by load" alone: for work that must move to another decode instance
    after its prefill ran (the one it was routed to died)."""
    decodes = _decode_candidates(view, prompt_tokens, costs)
    return view.decode[_argmin(decodes, 5)[0]] if decodes else None


def choose(
    view: ClusterView, req: ScheduleRequest, cfg: ConductorConfig, costs: Costs, now: float
) -> Choice | None:
    """Algorithm 1's selection; None when no prefill or no decode instance can take it."""
    match, candidates, ssd_of, worth = _prefill_candidates(view, req, cfg, costs, now)
    decodes = _decode_candidates(view, req.prompt_tokens, costs)
    if not candidates or not decodes:
        return None
    pid, local, prefix, transfer, queue, ttft = _argmin(candidates, 5)
    p = view.prefill[pid]
    # A prefill loads every leading block the store holds unless told otherwise: where the
    # cost model cut the prefix short of what was offered, the work carries the limit.
    offered = max(local, match.best_blocks if cfg.pool_fetch else 0)
    limit = None
    if prefix < offered and worth(offered)[0] < offered:
        limit = prefix
    d = view.decode[_argmin(decodes, 5)[0]]
    copy = None
    if prefix > local:  # p takes the pool's longest prefix: it keeps a copy of the blocks
        copy = CopyBlocks(p.node, req.keys[local:prefix], tuple(sorted(match.full_holders)))
    tokens = prefix_tokens(prefix, req.prompt_tokens, cfg.block_tokens)
    tbt = batch_tbt_s(view, costs, d.batch + 1, d.context_tokens + req.prompt_tokens)
    t_prefill, members = ttft - transfer - queue, tuple[str, ...]()
    if (g := group_for(view, p, tokens, req.prompt_tokens, queue, cfg, costs, now)) is not None:
        queue, t_prefill, members = g.queue_s, g.prefill_s, g.members
        ttft = transfer + queue + t_prefill
    return Choice(
        req, now, p, d, local, match.best_blocks, prefix, tokens, transfer, queue,
        t_prefill, ttft, tbt, copy, candidates, decodes, members, ssd_of[pid], limit,
    )  # fmt: skip


def group_for(
    view: ClusterView,
    leader: PrefillInstance,
    cached_tokens: int,
    prompt_tokens: int,
    leader_queue_s: float,
    cfg: ConductorConfig,
    costs: Costs,
    now: float,
) -> CppGroup | None:
    """CPP (core/cpp.py): the group led by Algorithm 1's instance that prefills the request
    sooner than it alone, with the least-queued other instances, or None. Every stage reuses
    the same cached prefix (each loads its own layers of the blocks)."""
    if cfg.cpp.max_stages < 2 or prompt_tokens - cached_tokens <= cfg.cpp.chunk_tokens:
        return None
    others = [(q.queue_s(now), q.id) for q in view.prefill_order if q.id != leader.id]
    return choose_group(
        costs.prefill.prefill_s, cfg.cpp, start=cached_tokens, end=prompt_tokens,
        leader_queue_s=leader_queue_s, others=others, hop_s=costs.hop_s(cfg.cpp.chunk_tokens),
    )  # fmt: skip


def decision_from(
    choice: Choice,
    policy: str,
    reason: RejectReason | None,
    cfg: ConductorConfig,
    *,
    tbt_s: float | None = None,
    decode_load: float | None = None,
    stage: str = "admission",
    extra: tuple[tuple[str, float], ...] = (),
    margin: float = 1.0,
) -> Decision:
    """A Decision carrying every input of `choice`; `tbt_s` / `decode_load` override the
    arrival-time decode prediction for policies that predict it differently. `margin`: the
    factor the policy judged the predicted TTFT by (`ttft_margin`): the prefill load is
    the judged TTFT's, the predicted TTFT stays the model's."""
    c = choice
    tbt = c.tbt_s if tbt_s is None else tbt_s
    if margin != 1.0:
        extra = (*extra, ("ttft_margin", margin))
    return Decision(
        request_id=c.request.request_id,
        policy=policy,
        admitted=reason is None,
        reason=reason,
        now=c.now,
        prompt_tokens=c.request.prompt_tokens,
        stage=stage,
        prefill_instance=c.prefill.id,
        decode_instance=c.decode.id,
        local_prefix_blocks=c.local_blocks,
        remote_prefix_blocks=c.best_blocks,
        prefix_tokens=c.prefix_tokens,
        ssd_prefix_blocks=c.ssd_blocks,
        load_limit_blocks=c.load_limit_blocks,
        takes_remote=c.copy is not None,
        transfer_s=c.transfer_s,
        queue_s=c.queue_s,
        prefill_s=c.prefill_s,
        predicted_ttft_s=c.ttft_s,
        predicted_tbt_s=tbt,
        prefill_load=c.ttft_s * margin / cfg.ttft_slo_s,
        decode_load=tbt / cfg.tbt_slo_s if decode_load is None else decode_load,
        copy=c.copy,
        config=cfg,
        candidates=c.candidates,
        decode_candidates=c.decode_candidates,
        extra=extra,
        stage_instances=c.stage_instances,
        tenant=c.request.tenant,
    )


def no_instance(req: ScheduleRequest, policy: str, cfg: ConductorConfig, now: float) -> Decision:
    return Decision(
        req.request_id, policy, False, RejectReason.NO_INSTANCE, now, req.prompt_tokens,
        config=cfg, tenant=req.tenant,
    )  # fmt: skip


def in_flight_limit(
    req: ScheduleRequest, policy: str, cfg: ConductorConfig, now: float
) -> Decision:
    """Refused before any choice: `cfg.max_inflight` requests are in flight already."""
    return Decision(
        req.request_id, policy, False, RejectReason.IN_FLIGHT_LIMIT, now, req.prompt_tokens,
        config=cfg, tenant=req.tenant,
    )  # fmt: skip


def rejection_detail(d: Decision) -> str:
    """Why a policy rejected a request, in words and numbers (the event's `detail`; the
    gateway shows it to the client)."""
    cfg = d.config
    ttft = f"{d.predicted_ttft_s:.2f} s" if d.predicted_ttft_s is not None else "unknown"
    tbt = f"{d.predicted_tbt_s * 1000:.0f} ms" if d.predicted_tbt_s is not None else "unknown"
    ttft_parts = (
        f"queue {d.queue_s:.2f} s + transfer {d.transfer_s:.2f} s + prefill {d.prefill_s:.2f} s"
        f" on {'+'.join((str(d.prefill_instance), *d.stage_instances))}"
    )
    tbt_slo, ttft_slo = f"{cfg.tbt_slo_s * 1000:.0f} ms", f"{cfg.ttft_slo_s:g} s"
    match d.reason:
        case RejectReason.NO_INSTANCE:
            return f"no live instance pair can take a prompt of {d.prompt_tokens:,} tokens"
        case RejectReason.IN_FLIGHT_LIMIT:
            return (
                f"the Conductor already tracks its limit of {cfg.max_inflight:,} requests in "
                "flight (conductor.max_inflight)"
            )
        case RejectReason.TTFT_SLO if (m := dict(d.extra).get("ttft_margin")) is not None:
            judged = (d.predicted_ttft_s or 0.0) * m
            return (
                f"predicted TTFT {ttft} ({ttft_parts}) x {m:.2f} (how far the latest TTFTs "
                f"missed their predictions, p{round(100 * (cfg.ttft_margin_quantile or 0))}) "
                f"= {judged:.2f} s is over the SLO of {ttft_slo}"
            )
        case RejectReason.TTFT_SLO:
            return f"predicted TTFT {ttft} ({ttft_parts}) is over the SLO of {ttft_slo}"
        case RejectReason.TBT_SLO:
            return f"predicted TBT {tbt} on {d.decode_instance} is over the SLO of {tbt_slo}"
        case RejectReason.PREFILL_OVERLOADED if dict(d.extra).get("calibrating"):
            return (
                f"{d.prefill_instance} is busy and the Conductor is still learning this "
                f"cluster's prefill speed from its first requests: until then only an idle "
                f"prefill instance takes work (predicted TTFT {ttft} on the starting model)"
            )
        case RejectReason.PREFILL_OVERLOADED:
            load = f"{d.prefill_load:.2f}" if d.prefill_load is not None else "over 1"
            return (
                f"prefill load {load} (predicted TTFT {ttft}: {ttft_parts}; SLO {ttft_slo}) "
                f"under the {d.policy} policy"
            )
        case RejectReason.TENANT_QUOTA:
            x = dict(d.extra)
            return (
                f"tenant {d.tenant} holds {x.get('tenant_share', 0.0):.0%} of the prefill work "
                f"in flight ({x.get('tenant_held_s', 0.0):.1f} s), over its fair share of "
                f"{x.get('tenant_fair', 0.0):.0%}, while the cluster is contended (prefill load "
                f"{d.prefill_load or 0.0:.2f} >= {cfg.tenants.contention:g}): other tenants' "
                "requests go first"
            )
        case RejectReason.DECODE_OVERLOADED:
            load = f"{d.decode_load:.2f}" if d.decode_load is not None else "over 1"
            return (
                f"decode load {load} (predicted TBT {tbt} on {d.decode_instance}; SLO {tbt_slo}) "
                f"under the {d.policy} policy"
            )
    return str(d.reason.value) if d.reason is not None else "rejected"


def slo_reason(ttft_s: float, tbt_s: float, cfg: ConductorConfig) -> RejectReason | None:
    if ttft_s > cfg.ttft_slo_s:
        return RejectReason.TTFT_SLO
    if tbt_s > cfg.tbt_slo_s:
        return RejectReason.TBT_SLO
    return None


def decide(
    view: ClusterView,
    req: ScheduleRequest,
    cfg: ConductorConfig,
    costs: Costs,
    now: float,
    policy: str = "early",
) -> Decision:
    """Algorithm 1 in full: selection, then reject if TTFT or TBT breaks its SLO."""
    choice = choose(view, req, cfg, costs, now)
    if choice is None:
        return no_instance(req, policy, cfg, now)
    return slo_decision(choice, view, cfg, policy)


def slo_decision(choice: Choice, view: ClusterView, cfg: ConductorConfig, policy: str) -> Decision:
    """Algorithm 1's SLO check of `choice`: TTFT (x `ttft_margin`) and TBT against their
    limits."""
    m = ttft_margin(view, cfg)
    tbt = choice.tbt_s if decode_shared(choice.decode) else 0.0
    reason = slo_reason(choice.ttft_s * m, tbt, cfg)
    return decision_from(choice, policy, reason, cfg, margin=m)


def decode_shared(d: DecodeInstance) -> bool:
    """Whether other requests run on (or are bound for) decode instance `d`. TBT is judged
    only then: an idle instance's predicted TBT is its step time alone, which no admission
    decision can lower, and rejecting it would free capacity for nobody (a slow machine would
    refuse every request). The decision still records the predicted TBT."""
    return d.batch + d.reserved_batch > 0


def ttft_margin(view: ClusterView, cfg: ConductorConfig) -> float:
    """The factor a rejecting policy judges predicted TTFT by (core/ttft_error.py)."""
    q = cfg.ttft_margin_quantile
    return 1.0 if q is None else view.ttft_errors.margin(q)


def assignment(decision: Decision, *, sampled: bool = True) -> Assigned | None:
    """The queue-time update after an assignment, as a fact for `ClusterView.apply`;
    `sampled`: whether its TTFT is a sample of the cost model's error (`Assigned`)."""
    if not decision.admitted or decision.prefill_instance is None:
        return None
    assert decision.decode_instance is not None and decision.predicted_ttft_s is not None
    return Assigned(
        decision.request_id,
        decision.prefill_instance,
        decision.decode_instance,
        decision.prompt_tokens,
        decision.prefill_s,
        decision.predicted_ttft_s,
        cached_tokens=decision.prefix_tokens,
        sampled=sampled,
        stage_instances=decision.stage_instances,
        tenant=decision.tenant,
    )

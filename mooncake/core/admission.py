"""Overload handling (PAPER.md §5): which requests to reject, and when.

Load is SLO pressure: prefill load = predicted TTFT / TTFT limit, decode load = predicted
TBT / TBT limit; a load above 1 breaks the SLO. Every policy runs Algorithm 1's selection
(`conductor.choose`) and differs only in the check:

- `none`: admit whatever an instance can take.
- `baseline`: no check on arrival; each stage checks its *own current* load when the request
  reaches it - `prefill_stage_check` when it is queued on the prefill instance (at dispatch,
  which is arrival, so `decide` runs it), `decode_stage_check` when its prefill has finished
  (a rejection there wastes the prefill).
- `early`: on arrival, reject if max(prefill load, decode load) > 1, with the decode load of
  the chosen instance as it is now. This is exactly Algorithm 1's SLO check.
- `predicted`: on arrival, the decode load is predicted *at the time this request's prefill
  will finish* (t = now + predicted TTFT), system-level: every request decodes for a uniform
  `uniform_decode_s`; at t, count the requests whose prefill will have finished and drop those
  whose decode will have ended; predicted load = mean over decode instances of predicted
  TBT / TBT limit - and, beyond the paper, never less than the predicted load of the
  instance this request joins. The paper's system-level mean alone let one overloaded
  instance hide behind idle ones: a request was admitted onto an instance whose predicted
  TBT broke the SLO, against the Conductor's rule that nothing admitted breaks it (the
  8P+2D overload run showed it: `predicted` ran its decode pool above the limit and had
  the least goodput). The mean is kept as the system-level signal the paper describes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from mooncake.core import conductor as cd
from mooncake.core.cluster import ClusterView, DecodeInstance
from mooncake.core.cost_model import Costs
from mooncake.core.tenancy import share_verdict
from mooncake.events import RejectReason

Policy = Literal["none", "baseline", "early", "predicted", "forecast"]
POLICIES: tuple[Policy, ...] = ("none", "baseline", "early", "predicted", "forecast")


def decide(
    policy: Policy,
    view: ClusterView,
    req: cd.ScheduleRequest,
    cfg: cd.ConductorConfig,
    costs: Costs,
    now: float,
) -> cd.Decision:
    """The admission decision on arrival under `policy`; every rejecting policy then holds
    each tenant to its share under contention (`tenant_share`). Every policy, `none`
    included, refuses a request past `cfg.max_inflight` requests in flight (the
    Conductor's memory bound)."""
    if len(view.inflight) >= cfg.max_inflight:
        return cd.in_flight_limit(req, policy, cfg, now)
    choice = cd.choose(view, req, cfg, costs, now)
    if choice is None:
        return cd.no_instance(req, policy, cfg, now)
    if policy == "none":
        return cd.decision_from(choice, policy, None, cfg)
    return tenant_share(_by_policy(policy, choice, view, cfg, costs, now), view, cfg)


def tenant_share(decision: cd.Decision, view: ClusterView, cfg: cd.ConductorConfig) -> cd.Decision:
    """An admission turned into a `tenant_quota` rejection where the cluster is contended
    (the predicted prefill load at least `cfg.tenants.contention`) and the request's tenant
    already holds more than its fair share of the prefill work in flight (core/tenancy.py)."""
    load = decision.prefill_load
    if not decision.admitted or load is None or load < cfg.tenants.contention:
        return decision
    if len(view.tenants_inflight) < 2:  # one tenant (or none) in flight: within its share
        return decision
    verdict = share_verdict(view.tenant_prefill_work(), decision.tenant, cfg.tenants)
    if not verdict.over:
        return decision
    extra = (
        ("tenant_held_s", verdict.held_s), ("tenant_share", verdict.share),
        ("tenant_fair", verdict.fair),
    )  # fmt: skip
    return dataclasses.replace(
        decision, admitted=False, reason=RejectReason.TENANT_QUOTA, stage="admission",
        extra=(*decision.extra, *extra),
    )  # fmt: skip


def _by_policy(
    policy: Policy, choice: cd.Choice, view: ClusterView, cfg: cd.ConductorConfig, costs: Costs,
    now: float,
) -> cd.Decision:  # fmt: skip
    """A rejecting policy's decision on `choice`. Each judges TTFT with the margin the latest
    misses call for."""
    req = choice.request
    m = cd.ttft_margin(view, cfg)
    match policy:
        case "baseline":
            verdict = prefill_stage_check(
                view, choice.prefill.id, req.prompt_tokens, choice.prefix_tokens,
                choice.transfer_s, cfg, costs, now, margin=m,
                stages=choice.stage_instances, group_prefill_s=choice.prefill_s,
            )  # fmt: skip
            return cd.decision_from(choice, policy, verdict.reason, cfg, stage="prefill", margin=m)
        case "early":
            return cd.slo_decision(choice, view, cfg, policy)
        case "predicted":
            return _predicted(choice, view, cfg, costs, m)
        case "forecast":
            return _forecast(choice, view, cfg, costs, m)
    raise ValueError(f"unknown admission policy {policy!r}")


# --- predicted -----------------------------------------------------------------------------------


def predicted_decode_batches(
    view: ClusterView, at: float, uniform_decode_s: float
) -> dict[str, tuple[int, int]]:
    """Each decode instance's (batch, context tokens) at time `at`, system-level: a request
    decodes on [start, start + t_d), start = its actual decode start, else its (predicted or
    actual) prefill finish."""
    out = {d.id: (0, 0) for d in view.decode_order}
    for r in view.inflight.values():
        start = r.decode_started_at if r.decode_started_at is not None else r.prefill_done_at
        if start <= at < start + uniform_decode_s and r.decode_instance in out:
            b, c = out[r.decode_instance]
            out[r.decode_instance] = (b + 1, c + r.context_tokens)
    return out


def predicted_decode_load(
    view: ClusterView,
    at: float,
    cfg: cd.ConductorConfig,
    costs: Costs,
    joining: tuple[str, int] | None = None,
) -> tuple[float, dict[str, float]]:
    """(mean over decode instances of predicted TBT at `at`, per-instance TBT); `joining` =
    (instance, context tokens) of the request being judged, added to its instance."""
    batches = predicted_decode_batches(view, at, cfg.uniform_decode_s)
    if joining is not None and joining[0] in batches:
        b, c = batches[joining[0]]
        batches[joining[0]] = (b + 1, c + joining[1])
    tbts = {iid: cd.batch_tbt_s(view, costs, b, c) for iid, (b, c) in batches.items()}
    mean = sum(tbts.values()) / len(tbts) if tbts else 0.0
    return mean, tbts


def _predicted(
    choice: cd.Choice, view: ClusterView, cfg: cd.ConductorConfig, costs: Costs, margin: float
) -> cd.Decision:
    at = choice.now + choice.ttft_s
    joining = (choice.decode.id, choice.request.prompt_tokens)
    mean, per_instance = predicted_decode_load(view, at, cfg, costs, joining)
    # The request's own TBT is its instance's, so the mean may not hide that instance.
    tbt = max(mean, per_instance.get(choice.decode.id, 0.0))
    extra = (
        ("predicted_at", at),
        ("tbt_mean_at", mean),
        *((f"tbt_at:{k}", v) for k, v in sorted(per_instance.items())),
    )
    return _judged_at(choice, "predicted", tbt, cfg, extra, margin)


def _judged_at(
    choice: cd.Choice,
    policy: Policy,
    tbt: float,
    cfg: cd.ConductorConfig,
    extra: tuple[tuple[str, float], ...],
    margin: float,
) -> cd.Decision:
    """A prediction-based policy's verdict: the TTFT (x `margin`) against its SLO, then the
    decode load it predicted at the end of this request's prefill (`tbt`) against 1."""
    load = tbt / cfg.tbt_slo_s
    reason = None
    if choice.ttft_s * margin > cfg.ttft_slo_s:
        reason = RejectReason.TTFT_SLO
    elif load > 1.0:
        reason = RejectReason.DECODE_OVERLOADED
    return cd.decision_from(
        choice, policy, reason, cfg, tbt_s=tbt, decode_load=load, extra=extra, margin=margin
    )


# --- forecast: ours, request-level ---------------------------------------------------------------


def forecast_decode_batches(
    view: ClusterView, now: float, at: float, uniform_decode_s: float
) -> dict[str, tuple[int, int]]:
    """Each decode instance's (batch, context tokens) at time `at`, request by request, from
    what the view sees of each: a request decoding now for `e` s is still there at `at`
    unless no finished decode ran `e + (at - now)` s; one still in prefill, whose decode
    starts at `f` (its predicted prefill end, not before now), is there if `f <= at` and
    some finished decode ran more than `at - f` s. Durations come from the latest finished
    requests (`ClusterView.finished`); before any has finished, the paper's uniform t_d.

    Why a request counts unless it cannot still be running, not by its chance of running:
    a TBT is scored by its slowest gaps, so a batch predicted right on average breaks the
    SLO about half the time. In the simulator's decode-bound run (8P+2D, TBT 30 ms), counting
    each request by P(still running) admitted more and lost goodput (225 of 1,500, and more
    rejections: 512), counting those with P >= 0.5 gave 355, P > 0.1 gave 581, and this
    rule 714 (358 rejected) - against the paper's uniform t_d at 155."""
    fin = view.finished
    longest = fin.longest if fin.durations else None
    out = {d.id: (0, 0) for d in view.decode_order}
    for r in view.inflight.values():
        if r.decode_instance not in out:
            continue
        began = r.decode_started_at
        start = began if began is not None else max(r.prefill_done_at, now)
        if start > at:
            continue  # its decode has not begun by then
        if longest is not None:
            there = at - start < longest
        else:
            there = at < start + uniform_decode_s
        if there:
            b, c = out[r.decode_instance]
            out[r.decode_instance] = (b + 1, c + r.context_tokens)
    return out


def _forecast(
    choice: cd.Choice, view: ClusterView, cfg: cd.ConductorConfig, costs: Costs, margin: float
) -> cd.Decision:
    """Admit if the TTFT fits and the chosen decode instance's batch when this request's
    prefill ends, with this request in it, keeps its predicted TBT under the SLO. Its own
    instance's TBT is the one this request will see, so no mean over instances."""
    at = choice.now + choice.ttft_s
    batches = forecast_decode_batches(view, choice.now, at, cfg.uniform_decode_s)
    b, c = batches.get(choice.decode.id, (0, 0))
    tbt = cd.batch_tbt_s(view, costs, b + 1, c + choice.request.prompt_tokens)
    extra = (("predicted_at", at), ("batch_at", float(b + 1)))
    return _judged_at(choice, "forecast", tbt, cfg, extra, margin)


# --- while the cost model is calibrating ----------------------------------------------------------


def while_calibrating(decision: cd.Decision, view: ClusterView, now: float) -> cd.Decision:
    """A rejecting policy's admission while the cost model rests on no measurement of the
    serving engine - the reference hardware's numbers, no profile, not yet fitted to this
    cluster's own prefill times (core/online_cost.py): only an idle prefill instance takes
    work. That seed can be off by orders of magnitude, and every request it admits onto a
    queue is admitted on that guess; an idle instance's prefill costs nobody a wait, and
    its timing is what ends the calibration. A live run without it (8xA800 seed on this
    2-core CPU, `early`, `bench memory` at 5x) admitted the whole burst before the first
    prefill finished and had not drained it after 13 minutes."""
    if not decision.admitted or decision.prefill_instance is None:
        return decision
    p = view.prefill.get(decision.prefill_instance)
    if p is None or p.queue_s(now) <= 0.0:
        return decision
    return dataclasses.replace(
        decision,
        admitted=False,
        reason=RejectReason.PREFILL_OVERLOADED,
        extra=(*decision.extra, ("calibrating", 1.0)),
    )


# --- baseline: the stages' own checks ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StageVerdict:
    """A stage's own check under the `baseline` policy."""

    accept: bool
    load: float
    predicted_s: float
    reason: RejectReason | None


def prefill_stage_check(
    view: ClusterView, instance: str, prompt_tokens: int, cached_tokens: int,
    transfer_s: float, cfg: cd.ConductorConfig, costs: Costs, now: float, margin: float = 1.0,
    stages: tuple[str, ...] = (), group_prefill_s: float | None = None,
) -> StageVerdict:  # fmt: skip
    """The prefill instance's check when the request reaches it: the prefix fetch, its queue
    and this prefill (x `margin`, `conductor.ttft_margin`), against the TTFT limit. A CPP
    group (`stages` after `instance`) waits for the last of its instances and takes the
    pipeline's `group_prefill_s`."""
    group = [view.prefill.get(i) for i in (instance, *stages)]
    if any(p is None for p in group):
        return StageVerdict(False, float("inf"), float("inf"), RejectReason.NO_INSTANCE)
    queue = max(p.queue_s(now) for p in group if p is not None)
    if stages and group_prefill_s is not None:
        t_prefill = group_prefill_s
    else:
        t_prefill = costs.prefill.prefill_s(prompt_tokens, cached_tokens)
    ttft = transfer_s + queue + t_prefill
    load = ttft * margin / cfg.ttft_slo_s
    reason = RejectReason.PREFILL_OVERLOADED if load > 1.0 else None
    return StageVerdict(reason is None, load, ttft, reason)


def decode_stage_check(
    view: ClusterView,
    decode: DecodeInstance,
    context_tokens: int,
    cfg: cd.ConductorConfig,
    costs: Costs,
) -> StageVerdict:
    """The decode instance's check when a prefilled request reaches it: its current running
    batch plus this request, against the TBT limit (and its KV capacity, if bounded)."""
    room = decode.kv_room()  # this request's own reservation is not counted against it
    if room is not None and context_tokens > room:
        return StageVerdict(False, float("inf"), float("inf"), RejectReason.DECODE_OVERLOADED)
    tbt = cd.batch_tbt_s(view, costs, decode.batch + 1, decode.context_tokens + context_tokens)
    load = tbt / cfg.tbt_slo_s
    busy = decode.batch > 0  # an idle instance is not overloaded by one request (decode_shared)
    reason = RejectReason.DECODE_OVERLOADED if load > 1.0 and busy else None
    return StageVerdict(reason is None, load, tbt, reason)

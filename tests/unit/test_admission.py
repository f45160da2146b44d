"""Admission policies (PAPER.md §5) on tiny scenarios whose numbers are worked out by hand.

Costs (from test_conductor): prefill 1 ms per uncached token; decode step
10 ms + 1 ms per sequence + 0.1 µs per context token. SLOs: TTFT 5 s, TBT 50 ms.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_conductor import CFG, COSTS, view

from mooncake.core import cluster as cl
from mooncake.core.admission import POLICIES, decide, decode_stage_check, prefill_stage_check
from mooncake.core.conductor import ConductorConfig, ScheduleRequest
from mooncake.core.conductor import decide as algorithm1
from mooncake.core.decode_forecast import WINDOW
from mooncake.events import RejectReason

CFG_TD = ConductorConfig(block_tokens=10, ttft_slo_s=5.0, tbt_slo_s=0.05, uniform_decode_s=10.0)


def request(tokens: int = 100, rid: str = "r") -> ScheduleRequest:
    return ScheduleRequest(rid, tokens, ())


def decoding(v: cl.ClusterView, n: int, at: float, decode: str = "d0", ctx: int = 100) -> None:
    """n requests (prefill on p1) that started decoding on `decode` at time `at`."""
    for i in range(n):
        v.apply(cl.Assigned(f"x{i}", "p1", decode, ctx, 0.0, 0.0), at)
        v.apply(cl.DecodeStarted(f"x{i}"), at)


def test_overloaded_prefill_none_admits_baseline_and_early_reject() -> None:
    v = view(1, 1)
    v.apply(cl.Assigned("busy", "p0", "d0", 0, 10.0, 10.0), 0.0)
    # TTFT = queue 10 s + prefill 100 tokens 0.1 s = 10.1 s > 5 s: prefill load 2.02.
    decisions = {p: decide(p, v, request(), CFG, COSTS, 0.0) for p in POLICIES}
    assert decisions["none"].admitted and decisions["none"].predicted_ttft_s == 10.1
    assert decisions["baseline"].reason is RejectReason.PREFILL_OVERLOADED
    assert decisions["baseline"].stage == "prefill"
    assert decisions["early"].reason is RejectReason.TTFT_SLO
    assert decisions["predicted"].reason is RejectReason.TTFT_SLO
    assert decisions["early"].prefill_load == pytest.approx(2.02)


def test_busy_decode_baseline_admits_then_the_decode_stage_rejects() -> None:
    v = view(2, 1)
    decoding(v, 45, at=0.0)
    # On arrival at t = 9.5: TTFT 0.1 s. d0 runs 45 sequences of 100 tokens:
    # step(46, 4600) = 0.010 + 0.046 + 0.00046 = 0.05646 s > 0.05 -> decode load 1.129.
    base = decide("baseline", v, request(), CFG_TD, COSTS, 9.5)
    assert base.admitted  # the baseline checks no decode load on arrival
    early = decide("early", v, request(), CFG_TD, COSTS, 9.5)
    assert early.reason is RejectReason.TBT_SLO
    assert early.predicted_tbt_s == pytest.approx(0.05646)
    # The decode stage, reached after the prefill, sees the same batch and rejects: the
    # prefill was wasted.
    verdict = decode_stage_check(v, v.decode["d0"], 100, CFG_TD, COSTS)
    assert not verdict.accept and verdict.reason is RejectReason.DECODE_OVERLOADED
    assert verdict.load == pytest.approx(0.05646 / 0.05)


def test_predicted_admits_what_will_have_drained_by_the_end_of_prefill() -> None:
    v = view(2, 1)
    decoding(v, 45, at=0.0)
    # Arrival at 9.5 with a 1000-token prompt: TTFT = 1.0 s, so its decode starts at 10.5.
    # With t_d = 10 s the 45 running requests end at 10.0 < 10.5: at 10.5 d0 holds only this
    # request: step(1, 1000) = 0.010 + 0.001 + 0.0001 = 0.0111 s -> load 0.222: admit.
    # Early rejects it: now d0 holds 45 + 1: step(46, 5500) = 0.05655 s > 0.05.
    assert decide("early", v, request(1000), CFG_TD, COSTS, 9.5).reason is RejectReason.TBT_SLO
    d = decide("predicted", v, request(1000), CFG_TD, COSTS, 9.5)
    assert d.admitted and d.predicted_tbt_s == pytest.approx(0.0111)
    assert d.decode_load == pytest.approx(0.222)
    assert dict(d.extra)["predicted_at"] == 10.5


def test_predicted_rejects_what_early_lets_in_a_burst_still_in_prefill() -> None:
    v = view(2, 2)
    # 45 admitted requests on d0 whose prefills (on p1) finish at 0.5 s; none decodes yet.
    for i in range(45):
        v.apply(cl.Assigned(f"x{i}", "p1", "d0", 100, 0.0, 0.5), 0.0)
    v.apply(cl.DecodeLoadReported("d1", 20, 0), 0.0)  # d1 runs 20 with no tracked requests
    # Early at t = 0: d0 committed step(46, ...) vs d1 step(21, ...) -> d1 is chosen; its
    # current load step(21, 1000) = 0.0311 s: admit.
    early = decide("early", v, request(1000), CFG_TD, COSTS, 0.0)
    assert early.admitted and early.decode_instance == "d1"
    # Predicted at t = 1.0 (TTFT 1 s): d0 holds the 45 (in [0.5, 10.5)), step(45, 4500) =
    # 0.05545; d1 holds only this request (its reported 20 are not tracked: system-level
    # prediction over the requests the Conductor admitted), step(1, 1000) = 0.0111.
    # Mean = 0.033275 s -> load 0.6655: admitted. Two more such bursts on d1 are not.
    d = decide("predicted", v, request(1000), CFG_TD, COSTS, 0.0)
    assert d.admitted and d.predicted_tbt_s == pytest.approx((0.05545 + 0.0111) / 2)
    for i in range(45):
        v.apply(cl.Assigned(f"y{i}", "p1", "d1", 100, 0.0, 0.5), 0.0)
    # Now d1 also holds 45 at t = 1.0: mean (0.05545 + 0.05655) / 2 = 0.056 > 0.05 and the
    # chosen d0 would hold 46: step(46, 5500) = 0.05655 -> reject, while early (current
    # batches 0 and 20) still admits.
    assert decide("early", v, request(1000), CFG_TD, COSTS, 0.0).admitted
    d = decide("predicted", v, request(1000), CFG_TD, COSTS, 0.0)
    assert d.reason is RejectReason.DECODE_OVERLOADED and d.decode_instance == "d0"
    assert d.predicted_tbt_s == pytest.approx(0.05655)
    assert dict(d.extra)["tbt_mean_at"] == pytest.approx((0.05545 + 0.05655) / 2)


def test_predicted_mean_does_not_hide_the_overloaded_instance_the_request_joins() -> None:
    v = view(2, 2)
    # d0: 48 admitted requests whose prefills finish at 0.5 s. d1 reports 60 running now
    # (untracked: they are not in the prediction), so d0 has the least committed work
    # (step(49, 5800) = 0.05958 < step(61, 1000) = 0.0711) and is chosen.
    for i in range(48):
        v.apply(cl.Assigned(f"x{i}", "p1", "d0", 100, 0.0, 0.5), 0.0)
    v.apply(cl.DecodeLoadReported("d1", 60, 0), 0.0)
    d = decide("predicted", v, request(1000), CFG_TD, COSTS, 0.0)
    # At t = 1.0: d0 holds 48 + this one: step(49, 5800) = 0.05958 s > 0.05; d1 holds
    # nothing tracked: step(0, 0) = 0.010. The paper's mean, 0.03479 s, would admit a
    # request whose own TBT breaks the SLO; the chosen instance's load rejects it.
    assert d.decode_instance == "d0" and d.reason is RejectReason.DECODE_OVERLOADED
    assert d.predicted_tbt_s == pytest.approx(0.05958)
    assert dict(d.extra)["tbt_mean_at"] == pytest.approx((0.05958 + 0.010) / 2)


def test_prefill_stage_check_counts_transfer_queue_and_prefill() -> None:
    v = view(1, 1)
    v.apply(cl.Assigned("busy", "p0", "d0", 0, 4.0, 4.0), 0.0)
    # 0.5 s fetch + 4 s queue + 600 uncached tokens 0.6 s = 5.1 s > 5 s.
    verdict = prefill_stage_check(v, "p0", 1000, 400, 0.5, CFG, COSTS, 0.0)
    assert verdict.reason is RejectReason.PREFILL_OVERLOADED
    assert verdict.load == pytest.approx(5.1 / 5.0)
    assert prefill_stage_check(v, "p0", 1000, 400, 0.0, CFG, COSTS, 0.0).accept
    assert prefill_stage_check(v, "nope", 1, 0, 0.0, CFG, COSTS, 0.0).reason is (
        RejectReason.NO_INSTANCE
    )


@settings(max_examples=100, deadline=None)
@given(st.floats(0, 8), st.integers(0, 60), st.integers(1, 3000), st.floats(0, 20))
def test_early_is_algorithm_1s_check_and_admitted_requests_keep_the_slo(
    q: float, batch: int, tokens: int, now: float
) -> None:
    v = view(2, 2)
    v.apply(cl.Assigned("busy", "p0", "d0", 0, q, q), 0.0)
    v.apply(cl.DecodeLoadReported("d1", batch, 0), 0.0)
    decoding(v, batch // 2, at=0.0, decode="d0")
    for policy in ("early", "predicted"):
        d = decide(policy, v, request(tokens), CFG_TD, COSTS, now)
        if d.admitted:
            assert d.predicted_ttft_s is not None and d.predicted_ttft_s <= CFG_TD.ttft_slo_s
            assert d.predicted_tbt_s is not None and d.predicted_tbt_s <= CFG_TD.tbt_slo_s
    assert decide("early", v, request(tokens), CFG_TD, COSTS, now) == algorithm1(
        v, request(tokens), CFG_TD, COSTS, now
    )


def _finish(v: cl.ClusterView, rid: str, output: int | None, at: float = 0.0) -> None:
    v.apply(cl.Assigned(rid, "p1", "d0", 10, 0.0, 0.0), at)
    v.apply(cl.DecodeStarted(rid), at)
    v.apply(cl.DecodeFinished(rid, output), at)


def test_the_view_forecasts_output_from_the_latest_finished_requests() -> None:
    v = view(2, 2)
    assert v.expected_output_tokens == 0.0  # nothing finished yet: no growth assumed
    _finish(v, "a", 100)
    _finish(v, "b", 300)
    _finish(v, "c", None)  # a finish that does not say: not counted
    assert v.expected_output_tokens == pytest.approx(200.0)
    v.apply(cl.DecodeFinished("a", 10_000), 1.0)  # redelivered: "a" already ended
    assert v.expected_output_tokens == pytest.approx(200.0)
    for i in range(WINDOW):  # the window slides: the oldest ones leave
        _finish(v, f"w{i}", 50)
    assert v.expected_output_tokens == pytest.approx(50.0)


def test_decode_load_counts_the_growth_of_every_member_by_the_expected_output() -> None:
    """Step(46, 4600) = 56.46 ms on arrival; once finished requests say a request generates
    200 tokens, each of the 46 members is counted at +200 tokens: +9,200 tokens of KV,
    + 0.92 ms. A batch that fits the SLO as admitted but not once grown is turned away."""
    cfg = ConductorConfig(block_tokens=10, ttft_slo_s=5.0, tbt_slo_s=0.057, uniform_decode_s=10.0)
    v = view(2, 1)
    decoding(v, 45, at=0.0)
    assert decide("early", v, request(), cfg, COSTS, 1.0).admitted  # 56.46 ms <= 57 ms
    _finish(v, "done", 200)
    grown = decide("early", v, request(), cfg, COSTS, 1.0)
    assert grown.predicted_tbt_s == pytest.approx(0.05646 + 46 * 200 * 1e-7)
    assert grown.reason is RejectReason.TBT_SLO
    stage = decode_stage_check(v, v.decode["d0"], 100, cfg, COSTS)
    assert stage.predicted_s == pytest.approx(0.05738) and not stage.accept


def test_forecast_keeps_a_request_seen_decoding_past_the_papers_uniform_t_d() -> None:
    """Arrival at 9.5 with a 1000-token prompt (TTFT 1 s, so `at` = 10.5): the paper's
    t_d = 10 s retires the 45 requests decoding on d0 since 0.0 and admits (step(1, 1000) =
    11.1 ms). Once a finished request has decoded for 30 s, nothing says the 45 end by
    10.5: `forecast` counts them and rejects."""
    v = view(2, 1)
    decoding(v, 45, at=0.0)
    before = decide("forecast", v, request(1000), CFG_TD, COSTS, 9.5)
    assert before.admitted  # no finished decode yet: the paper's uniform t_d decides
    assert before.predicted_tbt_s == pytest.approx(0.0111)
    v.apply(cl.Assigned("long", "p1", "d0", 10, 0.0, 0.0), -21.0)
    v.apply(cl.DecodeStarted("long"), -21.0)
    v.apply(cl.DecodeFinished("long", 600), 9.0)
    assert v.finished.longest == pytest.approx(30.0)
    assert decide("predicted", v, request(1000), CFG_TD, COSTS, 9.5).admitted
    d = decide("forecast", v, request(1000), CFG_TD, COSTS, 9.5)
    assert d.reason is RejectReason.DECODE_OVERLOADED
    # d0 at 10.5: the 45 and this request, each grown by the mean output (600 tokens).
    assert d.predicted_tbt_s == pytest.approx(0.05655 + 46 * 600 * 1e-7)
    assert dict(d.extra)["batch_at"] == 46.0


def test_forecast_drops_a_request_past_the_longest_decode_and_one_not_yet_decoding() -> None:
    """A request decoding for longer than any finished one is taken to end; a request whose
    prefill ends after `at` is not in the batch at `at`."""
    v = view(2, 1)
    v.apply(cl.Assigned("done", "p1", "d0", 10, 0.0, 0.0), 0.0)
    v.apply(cl.DecodeStarted("done"), 0.0)
    v.apply(cl.DecodeFinished("done", 0), 5.0)  # the longest decode seen: 5 s
    decoding(v, 45, at=0.0)  # on d0 since 0.0
    for i in range(45):  # on d0 too, prefills ending at 20.0
        v.apply(cl.Assigned(f"late{i}", "p1", "d0", 100, 0.0, 20.0), 0.0)
    # At 9.5 (`at` 10.5): the 45 decoding have run 10.5 s > 5 s: ended; the 45 late ones
    # start at 20.0 > 10.5: not there yet. d0 holds only this request: step(1, 1000).
    d = decide("forecast", v, request(1000), CFG_TD, COSTS, 9.5)
    assert d.admitted and d.predicted_tbt_s == pytest.approx(0.0111)
    # Asked at 19.5 (`at` 20.5): the 45 late ones have started (at 20.0), the 45 decoding
    # since 0.0 are long gone: step(46, 5500) = 56.55 ms > 50 ms.
    later = decide("forecast", v, request(1000), CFG_TD, COSTS, 19.5)
    assert dict(later.extra)["batch_at"] == 46.0
    assert later.reason is RejectReason.DECODE_OVERLOADED


def test_while_calibrating_only_an_idle_prefill_instance_takes_work() -> None:
    from mooncake.core.admission import while_calibrating
    from mooncake.core.conductor import rejection_detail

    v = view(2, 1)
    idle = decide("early", v, request(), CFG, COSTS, 0.0)
    assert while_calibrating(idle, v, 0.0) is idle  # p0 has no queue: admitted as decided
    v.apply(cl.Assigned("busy", "p0", "d0", 0, 2.0, 2.0), 0.0)
    v.apply(cl.Assigned("busy2", "p1", "d0", 0, 2.0, 2.0), 0.0)
    queued = decide("early", v, request(), CFG, COSTS, 0.0)
    assert queued.admitted  # 2 s of queue + 0.1 s: well inside the 5 s TTFT SLO
    held = while_calibrating(queued, v, 0.0)
    assert not held.admitted and held.reason is RejectReason.PREFILL_OVERLOADED
    assert dict(held.extra)["calibrating"] == 1.0
    assert "still learning this cluster's prefill speed" in rejection_detail(held)
    rejected = decide("early", v, request(10_000), CFG, COSTS, 0.0)
    assert while_calibrating(rejected, v, 0.0) is rejected  # a rejection stays as it was


def test_past_max_inflight_every_policy_refuses_and_an_end_makes_room() -> None:
    import dataclasses

    from mooncake.core.conductor import rejection_detail

    cfg = dataclasses.replace(CFG, max_inflight=3)
    v = view(2, 2)
    for i in range(3):
        v.apply(cl.Assigned(f"x{i}", "p0", "d0", 10, 0.01, 0.01), 0.0)
    for p in POLICIES:
        d = decide(p, v, request(), cfg, COSTS, 0.0)
        assert (d.admitted, d.reason, d.stage) == (False, RejectReason.IN_FLIGHT_LIMIT, "admission")
        assert "limit of 3 requests in flight (conductor.max_inflight)" in rejection_detail(d)
    v.apply(cl.RequestDropped("x0"), 0.0)  # one ended: room for one
    assert all(decide(p, v, request(), cfg, COSTS, 0.0).admitted for p in ("none", "early"))

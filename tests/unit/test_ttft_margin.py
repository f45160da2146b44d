"""Judging TTFT by how far the latest predictions missed (core/ttft_error.py), and the queue
predicted again when the cost model changes (`ClusterView.reestimate`). Numbers by hand.

Costs (test_conductor): prefill 1 ms per uncached token. TTFT SLO 5 s.
"""

from __future__ import annotations

import dataclasses

import pytest
from test_conductor import CFG, COSTS, view

from mooncake.core import cluster as cl
from mooncake.core.admission import POLICIES, decide
from mooncake.core.conductor import ScheduleRequest, assignment, rejection_detail
from mooncake.core.ttft_error import MAX_MARGIN, MIN_MARGIN, MIN_SAMPLES, TtftErrors
from mooncake.events import RejectReason


def test_the_margin_is_the_nearest_rank_quantile_once_there_are_enough() -> None:
    e = TtftErrors(window=10, min_samples=4)
    for observed in (1.0, 1.2, 1.4):
        e.add(observed, 1.0)
    assert e.margin(0.9) == 1.0  # 3 < 4 samples: no margin yet
    e.add(2.0, 1.0)
    assert e.margin(0.9) == 2.0 and e.margin(0.5) == 1.2  # ceil(3.6)=4th, ceil(2)=2nd
    e.add(0.0, 1.0)  # nonsense is ignored
    e.add(1.0, 0.0)
    assert len(e) == 4
    for _ in range(10):  # the window slides: only the latest 10
        e.add(1.1, 1.0)
    assert e.margin(0.9) == pytest.approx(1.1)
    for _ in range(10):
        e.add(100.0, 1.0)
    assert e.margin(0.9) == MAX_MARGIN
    for _ in range(10):
        e.add(0.01, 1.0)
    assert e.margin(0.9) == MIN_MARGIN


def test_a_refit_rescales_the_misses_by_each_requests_prefill_change() -> None:
    e = TtftErrors(window=10, min_samples=2)
    e.add(3.0, 2.0, 1000, 0, 1.0)  # missed by 1.5x; its own prefill predicted at 1 s
    e.add(6.0, 4.0, 3000, 1000, 2.0)  # missed by 1.5x; 2 s of prefill
    e.add(1.2, 1.0)  # no prefill given: kept as it is
    assert e.margin(1.0) == pytest.approx(1.5) and e.margin(0.3) == pytest.approx(1.2)
    # The new model: 1.5 ms per uncached token, 1.5x the old for both.
    e.rescale(lambda prompt, cached: 0.0015 * (prompt - cached))
    assert e.margin(1.0) == pytest.approx(1.2)  # the unscaled one now misses most
    assert e.margin(0.5) == pytest.approx(1.0)
    e.rescale(lambda prompt, cached: 0.0)  # a nonsense price changes nothing
    assert e.margin(1.0) == pytest.approx(1.2) and e.margin(0.5) == pytest.approx(1.0)


@dataclasses.dataclass(frozen=True)
class _PerToken:
    s: float

    def prefill_s(self, prompt_tokens: int, cached_tokens: int) -> float:
        return self.s * (prompt_tokens - cached_tokens)


def _missed(v: cl.ClusterView, factor: float, n: int = MIN_SAMPLES) -> None:
    """`n` requests on p0 whose TTFT was `factor` x its 1 s prediction."""
    t = 1000.0
    for i in range(n):
        v.apply(cl.Assigned(f"m{i}", "p0", "d0", 100, 1.0, 1.0), t)
        v.apply(cl.PrefillFinished(f"m{i}"), t + factor)
        v.apply(cl.DecodeFinished(f"m{i}"), t + factor)
        t += 10.0


def test_every_rejecting_policy_judges_ttft_with_the_margin() -> None:
    v = view(1, 1)
    _missed(v, 1.6)
    # 3,500 tokens: TTFT predicted 3.5 s, under the 5 s SLO; judged 3.5 x 1.6 = 5.6 s: over.
    req = ScheduleRequest("r", 3500, ())
    d = {p: decide(p, v, req, CFG, COSTS, 2000.0) for p in POLICIES}
    assert d["none"].admitted  # admits whatever an instance can take
    assert d["early"].reason is RejectReason.TTFT_SLO
    assert d["predicted"].reason is RejectReason.TTFT_SLO
    assert d["forecast"].reason is RejectReason.TTFT_SLO
    assert d["baseline"].reason is RejectReason.PREFILL_OVERLOADED
    early = d["early"]
    assert early.predicted_ttft_s == pytest.approx(3.5)  # the model's own prediction
    assert early.prefill_load == pytest.approx(5.6 / 5.0)  # the load as judged
    assert dict(early.extra)["ttft_margin"] == pytest.approx(1.6)
    assert "x 1.60" in rejection_detail(early) and "= 5.60 s" in rejection_detail(early)
    # Without the margin (the setting off), the same request is admitted.
    off = dataclasses.replace(CFG, ttft_margin_quantile=None)
    assert all(decide(p, v, req, off, COSTS, 2000.0).admitted for p in POLICIES)


def test_a_refit_to_the_slow_prefills_that_made_the_margin_takes_it_back() -> None:
    v = view(1, 1)
    _missed(v, 1.6)  # 100-token prefills predicted at 1 s took 1.6 s
    req = ScheduleRequest("r", 3500, ())
    assert not decide("early", v, req, CFG, COSTS, 2000.0).admitted  # 3.5 x 1.6 > 5 s
    # The model refits to the same prefills (1.6 s for 100 tokens): the misses are gone, and
    # a request the new model predicts under the SLO is admitted.
    slow = dataclasses.replace(COSTS, prefill=_PerToken(0.016))
    v.reestimate(slow.prefill.prefill_s, 2000.0)
    assert v.ttft_errors.margin(CFG.ttft_margin_quantile or 0.9) == pytest.approx(1.0)
    assert decide("early", v, ScheduleRequest("r", 300, ()), CFG, slow, 2000.0).admitted  # 4.8 s
    assert not decide("early", v, ScheduleRequest("r", 350, ()), CFG, slow, 2000.0).admitted


def test_a_refit_mid_prefill_keeps_each_queued_prediction_from_its_admission() -> None:
    v = view(1, 1)
    # a (10,000 tokens, 10 s) runs from 0; q (1,000) is admitted at 9 with 1 s of a left.
    v.apply(cl.Assigned("a", "p0", "d0", 10_000, 10.0, 10.0), 0.0)
    v.apply(cl.PrefillStarted("a"), 0.0)
    v.apply(cl.Assigned("q", "p0", "d0", 1000, 1.0, 2.0), 9.0)
    # At 9.5 the model halves: a "should" have ended at 5; q's end is now (clamped), and its
    # TTFT from its admission to there, never under its own 0.5 s prefill.
    v.reestimate(lambda prompt, cached: 0.0005 * (prompt - cached), 9.5)
    q = v.inflight["q"]
    assert q.prefill_done_at == pytest.approx(9.5)
    assert q.predicted_ttft_s == pytest.approx(0.5)
    assert v.inflight["a"].predicted_ttft_s == pytest.approx(5.0)


def test_a_pessimistic_model_admits_past_its_prediction() -> None:
    v = view(1, 1)
    _missed(v, 0.5)
    # 6,000 tokens: predicted 6 s > 5 s; every recent request took half its prediction.
    d = decide("early", v, ScheduleRequest("r", 6000, ()), CFG, COSTS, 2000.0)
    assert d.admitted and d.prefill_load == pytest.approx(3.0 / 5.0)


def test_unsampled_admissions_teach_the_margin_nothing() -> None:
    v = view(1, 1)
    for i in range(MIN_SAMPLES):
        v.apply(cl.Assigned(f"s{i}", "p0", "d0", 100, 1.0, 1.0, sampled=False), 10.0 * i)
        v.apply(cl.PrefillFinished(f"s{i}"), 10.0 * i + 9.0)
    assert len(v.ttft_errors) == 0
    req = ScheduleRequest("r", 100, ())
    admitted = decide("early", v, req, CFG, COSTS, 500.0)
    fact = assignment(admitted, sampled=False)
    assert fact is not None and fact.sampled is False and fact.cached_tokens == 0


def test_a_refit_predicts_the_queue_again() -> None:
    v = view(2, 1)
    # p0 runs a (1,000 tokens, 200 cached) from t=0 and queues b (2,000) and c (500): each
    # predicted with the old model, 1 ms per uncached token.
    v.apply(cl.Assigned("a", "p0", "d0", 1000, 0.8, 0.8, cached_tokens=200), 0.0)
    v.apply(cl.PrefillStarted("a"), 0.0)
    v.apply(cl.Assigned("b", "p0", "d0", 2000, 2.0, 2.8), 0.0)
    v.apply(cl.Assigned("c", "p0", "d0", 500, 0.5, 3.3), 0.0)
    p0 = v.prefill["p0"]
    assert p0.queue_s(0.5) == pytest.approx(0.3 + 2.5)
    # The new model: 2 ms per uncached token.
    v.reestimate(lambda prompt, cached: 0.002 * (prompt - cached), 0.5)
    assert p0.running_ends_at == pytest.approx(1.6)  # a: 1.6 s from its start at 0
    assert p0.queued == {"b": pytest.approx(4.0), "c": pytest.approx(1.0)}
    assert p0.queue_s(0.5) == pytest.approx(1.1 + 5.0)
    # Each one's predicted end moves by everything ahead of it and its own change.
    assert v.inflight["a"].prefill_done_at == pytest.approx(1.6)
    assert v.inflight["b"].prefill_done_at == pytest.approx(2.8 + 0.8 + 2.0)
    assert v.inflight["c"].prefill_done_at == pytest.approx(3.3 + 0.8 + 2.0 + 0.5)
    # And so does the TTFT each will be judged against when it ends (the margin's sample).
    assert [v.inflight[r].predicted_ttft_s for r in "abc"] == [
        pytest.approx(0.8 + 0.8),
        pytest.approx(2.8 + 2.8),
        pytest.approx(3.3 + 3.3),
    ]
    # A request that finishes still takes its queued seconds, the new ones, with it.
    v.apply(cl.PrefillFinished("a"), 1.7)
    v.apply(cl.PrefillStarted("b"), 1.7)
    assert p0.queued_s == pytest.approx(1.0)
    assert v.prefill["p1"].queue_s(0.5) == 0.0  # an idle instance is untouched

"""OnlineCostModel: the Conductor's cost model, refitted from the timings workers report."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.core.cost_model import (
    FittedCostModel,
    fit_decode,
    fit_prefill,
    load_s_per_token,
    reference_costs,
)
from mooncake.core.online_cost import OnlineCostModel, OnlineSettings


def true_prefill(prompt: int, cached: int) -> float:
    """The machine as it runs: 50 ms + 2 ms per new token + attention (the profile's
    feature basis, so a fit can be exact)."""
    new = prompt - cached
    return 0.05 + 0.002 * new + 1e-7 * (prompt * prompt - cached * cached)


def true_step(batch: int, context: int) -> float:
    return 0.02 + 0.003 * batch + 2e-7 * context


PROFILE_PREFILL = [(float(p), 0.0, true_prefill(p, 0) / 2) for p in (64, 256, 1024, 4096)]
PROFILE_DECODE = [(float(b), float(b * 500), true_step(b, b * 500) / 2) for b in (1, 4, 16)]


def test_with_a_profile_it_follows_a_machine_twice_as_slow_as_profiled() -> None:
    m = OnlineCostModel(
        reference_costs().prefill,
        reference_costs().decode,
        prefill_prior=PROFILE_PREFILL,
        decode_prior=PROFILE_DECODE,
    )
    assert m.prefill_s(1000, 0) == pytest.approx(m.seed_prefill.prefill_s(1000, 0))
    assert m.observe_prefill(1000, 0, true_prefill(1000, 0))  # the first one refits
    assert m.prefill_s(1000, 0) != m.seed_prefill.prefill_s(1000, 0)
    for i in range(200):
        p = 100 + (i * 37) % 3000
        m.observe_prefill(p, p // 4, true_prefill(p, p // 4))
    for b in (1, 2, 4, 8) * 10:
        m.observe_decode(b, b * 800, true_step(b, b * 800), steps=5)
    # The observations outnumber the profile's rows: predictions land near the machine's
    # real times, twice the profile's.
    for p, c in ((500, 0), (2000, 1000), (3000, 0)):
        assert m.prefill_s(p, c) == pytest.approx(true_prefill(p, c), rel=0.1)
    assert m.decode_step_s(6, 4800) == pytest.approx(true_step(6, 4800), rel=0.1)
    st_ = m.state()
    assert st_["cost_prefill_fitted"] == st_["cost_decode_fitted"] == 1.0
    assert st_["cost_prefill_observed"] == 201 and st_["cost_prefill_refits"] >= 25
    assert st_["cost_prefill_error"] == pytest.approx(1.0, abs=0.1)
    assert m.error("prefill") == st_["cost_prefill_error"]
    assert m.error("decode") == st_["cost_decode_error"]


def test_without_rows_it_answers_from_the_seed_until_enough_varied_samples() -> None:
    seed = reference_costs()
    m = OnlineCostModel(seed.prefill, seed.decode, settings=OnlineSettings(min_samples=8))
    for _ in range(50):  # fifty prompts of one size: a fit would be flat
        m.observe_prefill(1000, 0, true_prefill(1000, 0))
    assert m.prefill_s(8000, 0) == seed.prefill.prefill_s(8000, 0)
    assert m.state()["cost_prefill_fitted"] == 0.0
    assert m.state()["cost_prefill_error"] > 10  # the A800 is far faster than this machine
    m.observe_prefill(200, 0, true_prefill(200, 0))  # two sizes: spread 5, a first fit
    assert m.state()["cost_prefill_fitted"] == 1.0
    for p in (400, 800, 1600, 3200, 6400, 250, 500, 300):  # the next refit: 8 later
        m.observe_prefill(p, 0, true_prefill(p, 0))
    assert m.state()["cost_prefill_refits"] == 2
    assert m.prefill_s(5000, 0) == pytest.approx(true_prefill(5000, 0), rel=0.05)


def test_nonsense_observations_are_ignored() -> None:
    seed = reference_costs()
    m = OnlineCostModel(seed.prefill, seed.decode, prefill_prior=PROFILE_PREFILL)
    for bad in ((0, 0, 1.0), (100, 200, 1.0), (100, -1, 1.0), (100, 0, 0.0), (100, 0, -1.0)):
        assert not m.observe_prefill(*bad)
    assert not m.observe_decode(0, 100, 0.1)
    assert not m.observe_decode(2, 100, 0.0)
    assert not m.observe_decode(2, 100, 0.1, steps=0)
    assert m.state()["cost_prefill_observed"] == m.state()["cost_decode_observed"] == 0


def test_refits_come_every_refit_every_observations_or_at_once_when_one_is_off() -> None:
    seed = reference_costs()
    cfg = OnlineSettings(refit_every=4)
    m = OnlineCostModel(seed.prefill, seed.decode, prefill_prior=PROFILE_PREFILL, settings=cfg)

    def profiled(p: int) -> float:  # the machine as profiled: predictions stay within 25 %
        return true_prefill(p, 0) / 2

    refits = [m.observe_prefill(100 * (i + 1), 0, profiled(100 * (i + 1))) for i in range(9)]
    assert refits == [True, False, False, False, True, False, False, False, True]
    assert m.refits == 3
    assert m.observe_prefill(1000, 0, 2 * profiled(1000))  # 2x slower: refitted at once
    assert not m.observe_prefill(1000, 0, m.prefill_s(1000, 0))  # on the mark: it waits


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 20_000), st.floats(0, 1), st.floats(0.01, 100)),
        min_size=1,
        max_size=60,
    )
)
def test_the_refit_keeps_the_physics_whatever_it_is_fed(
    obs: list[tuple[int, float, float]],
) -> None:
    """Prefill never gets faster with a longer prompt or slower with a longer cached prefix,
    however noisy the observations (the fit's coefficients are non-negative)."""
    seed = reference_costs()
    m = OnlineCostModel(seed.prefill, seed.decode, prefill_prior=PROFILE_PREFILL)
    for prompt, share, seconds in obs:
        m.observe_prefill(prompt, int(prompt * share), seconds)
    for p in (10, 1000, 10_000):
        assert m.prefill_s(p + 500, 0) >= m.prefill_s(p, 0)
        assert m.prefill_s(p, p // 2) <= m.prefill_s(p, 0)


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        OnlineSettings(window=0)
    with pytest.raises(ValueError):
        OnlineSettings(min_spread=0.5)


def test_facts_with_timings_feed_the_model_and_others_do_not() -> None:
    from mooncake.core import cluster as cl
    from mooncake.core.online_cost import observe_fact

    seed = reference_costs()
    m = OnlineCostModel(seed.prefill, seed.decode)
    assert observe_fact(m, cl.PrefillFinished("r", 300, 128, 0.25)) == "prefill"
    assert observe_fact(m, cl.PrefillFinished("r")) is None  # no timing reported
    step = cl.DecodeLoadReported("d", 3, 900, None, None, 40, 0.05, 2.5, 800.0)
    assert observe_fact(m, step) == "decode"
    assert observe_fact(m, cl.DecodeLoadReported("d", 3, 900)) is None  # no steps
    assert observe_fact(m, cl.DecodeStarted("r")) is None
    st_ = m.state()
    assert st_["cost_prefill_observed"] == st_["cost_decode_observed"] == 1


def test_step_times_measure_the_period_between_step_starts() -> None:
    from mooncake.serving.decode_loop import StepTimes

    t = StepTimes()
    assert t.take() == (0, None, None, None)
    t.started(10.0, 2, 200)  # the first step: no period yet
    t.started(10.1, 3, 300)  # served the 2-sequence step: 0.1 s
    t.started(10.3, 3, 303)  # served the 3-sequence step: 0.2 s
    t.idle()  # the batch emptied: the next start begins a new series
    t.started(50.0, 1, 10)
    assert t.take() == pytest.approx((2, 0.15, 2.5, 250.0))
    assert t.take() == (0, None, None, None)
    t.started(50.2, 1, 11)
    assert t.take() == pytest.approx((1, 0.2, 1.0, 10.0))


def test_calibrated_means_measured_rows_or_a_fit() -> None:
    seed = reference_costs()
    assert OnlineCostModel(
        seed.prefill, seed.decode, prefill_prior=PROFILE_PREFILL
    ).prefill_calibrated
    m = OnlineCostModel(seed.prefill, seed.decode, settings=OnlineSettings(min_samples=2))
    assert not m.prefill_calibrated
    m.observe_prefill(100, 0, 0.5)
    assert not m.prefill_calibrated  # one sample: not enough
    m.observe_prefill(400, 0, 2.0)
    assert m.prefill_calibrated


def test_an_engines_timings_at_start_calibrate_the_model_at_once() -> None:
    from mooncake.core import cluster as cl
    from mooncake.core.online_cost import observe_fact

    seed = reference_costs()
    m = OnlineCostModel(seed.prefill, seed.decode)
    assert not m.prefill_calibrated
    rows = tuple((float(p), 0.0, true_prefill(p, 0)) for p in (64, 512, 2048))
    assert observe_fact(m, cl.EngineCalibrated("p1", "prefill", rows)) == "prefill"
    assert m.prefill_calibrated and m.state()["cost_prefill_fitted"] == 1.0
    assert m.prefill_s(1000, 0) == pytest.approx(true_prefill(1000, 0), rel=0.02)
    steps = tuple((float(b), b * 256.0, true_step(b, b * 256)) for b in (1, 4, 16))
    assert observe_fact(m, cl.EngineCalibrated("d1", "decode", steps)) == "decode"
    assert m.decode_step_s(8, 2048) == pytest.approx(true_step(8, 2048), rel=0.02)
    # Nonsense rows are dropped; none left: nothing happens.
    assert observe_fact(m, cl.EngineCalibrated("p2", "prefill", ((0.0, 0.0, 1.0),))) is None


def test_two_timings_extrapolate_with_the_flops_shape_of_the_model() -> None:
    """A worker's calibration gives two short prefills. On a machine whose prefill time
    follows the FLOPs of PAPER.md §4 for SmolLM2 (d = 576), the shaped fit predicts an
    8,192-token prefill within 2 %; the whole polynomial, given the same two rows, fits them
    exactly with whichever two of its terms come first and misses by a factor of several."""
    from mooncake.core import cluster as cl
    from mooncake.core.online_cost import attention_per_token, observe_fact

    k = attention_per_token(576)

    def machine(prompt: float, cached: float) -> float:
        return 0.2 + 1e-3 * ((prompt - cached) + k * (prompt * prompt - cached * cached))

    rows = tuple((float(p), 0.0, machine(p, 0)) for p in (64, 512))
    seed = reference_costs()
    shaped = OnlineCostModel(seed.prefill, seed.decode, hidden=576)
    plain = OnlineCostModel(seed.prefill, seed.decode)
    for m in (shaped, plain):
        observe_fact(m, cl.EngineCalibrated("p1", "prefill", rows))
    assert shaped.prefill_s(8192, 0) == pytest.approx(machine(8192, 0), rel=0.02)
    assert shaped.prefill_s(8192, 4096) == pytest.approx(machine(8192, 4096), rel=0.02)
    miss = plain.prefill_s(8192, 0) / machine(8192, 0)
    assert miss > 2 or miss < 0.5


def test_three_timings_fit_an_attention_share_the_flops_do_not_predict() -> None:
    """Where the GEMMs run on faster units than the attention (bfloat16 GEMMs on AMX beside
    float32-rate attention: issue 42), the attention term weighs several times what the
    FLOPs' k says. Two timings keep k and call a 3,000-token prefill too cheap; a
    calibration of three sizes fits the term's weight and predicts it within 5 %."""
    from mooncake.core import cluster as cl
    from mooncake.core.online_cost import attention_per_token, observe_fact

    k = 5 * attention_per_token(576)

    def machine(prompt: float, cached: float) -> float:
        return 0.02 + 3e-4 * ((prompt - cached) + k * (prompt * prompt - cached * cached))

    seed = reference_costs()
    two = OnlineCostModel(seed.prefill, seed.decode, hidden=576)
    three = OnlineCostModel(seed.prefill, seed.decode, hidden=576)
    for m, sizes in ((two, (64, 512)), (three, (64, 512, 2048))):
        rows = tuple((float(p), 0.0, machine(p, 0)) for p in sizes)
        observe_fact(m, cl.EngineCalibrated("p1", "prefill", rows))
    assert two.prefill_s(3000, 0) < 0.8 * machine(3000, 0)
    assert three.prefill_s(3000, 0) == pytest.approx(machine(3000, 0), rel=0.05)
    assert three.prefill_s(3000, 512) == pytest.approx(machine(3000, 512), rel=0.05)


def test_loading_costs_what_the_profile_measured_and_a_slow_cluster_is_slow_compute() -> None:
    """A profile whose engine loads a cached token in 1 ms (more than computing one saves):
    the refit keeps that cost and fits the computing to the rest, so a cluster twice as
    slow as profiled, whose prefills mostly reuse a quarter of the prompt, reads as slower
    computing (what it is), not as loading that got dearer."""

    def machine(prompt: int, cached: int, speed: float) -> float:
        return true_prefill(prompt, cached) / speed + 0.001 * cached

    rows = [(float(p), float(c), machine(p, c, 2.0)) for p in (64, 256, 1024, 4096)
            for c in (0, p // 2)]  # fmt: skip
    seed = FittedCostModel(fit_prefill(rows), fit_decode(PROFILE_DECODE))
    assert load_s_per_token(seed) == pytest.approx(0.001)
    m = OnlineCostModel(seed, seed, prefill_prior=rows, decode_prior=PROFILE_DECODE)
    for i in range(200):
        p = 100 + (i * 37) % 3000
        m.observe_prefill(p, p // 4, machine(p, p // 4, 1.0))
    for p in (500, 2000, 3000):
        assert m.prefill_s(p, 0) == pytest.approx(machine(p, 0, 1.0), rel=0.1)
    # Loading 1 ms a token against the ~2 ms computing saves: reusing pays, and the
    # prediction is of the whole prefix loaded.
    assert m.prefill_s(2000, 1000) == pytest.approx(machine(2000, 1000, 1.0), rel=0.1)

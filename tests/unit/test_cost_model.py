"""Cost model: polynomial fit, analytic reference model, transfer, and their physics."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.core.cost_model import (
    A800_X8,
    H800_X8,
    LLAMA3_70B,
    AnalyticCostModel,
    TransferModel,
    fit_nonnegative,
    parse_profile,
    poly_prefill_s,
    prefill_features,
    reuse,
    reuse_point,
)

TRUE_PREFILL = (0.02, 3e-5, 1e-9, 2e-10, 0.0)  # 1, n, n², L² - P², P (loading: free here)
# A small model on a GPU (the issue "Engine speed": a cached prefix of SmolLM2 prefilled
# slower than from scratch on an H100): loading a cached token costs more than computing
# it saves, until the prefix is long enough for the attention it saves to pay.
COSTLY_LOAD = (0.001, 2e-6, 0.0, 4e-11, 5e-6)
TRUE_DECODE = (0.012, 1e-4, 4e-8)  # 1, batch, context


def true_prefill(prompt: int, cached: int, coef: tuple[float, ...] = TRUE_PREFILL) -> float:
    return float(np.dot(coef, prefill_features(prompt, cached)))


def profile(
    noise: float = 0.0, seed: int = 0, coef: tuple[float, ...] = TRUE_PREFILL
) -> dict[str, object]:
    rng = np.random.default_rng(seed)
    pre = [
        {"prompt_tokens": p, "cached_tokens": c, "seconds": true_prefill(p, c, coef)}
        for p in (128, 512, 1024, 2048, 4096, 8192, 16384)
        for c in (0, p // 4, p // 2, p - 64)
    ]
    dec = [
        {"batch": b, "context_tokens": ctx, "seconds": float(np.dot(TRUE_DECODE, (1, b, ctx)))}
        for b in (1, 4, 16, 64)
        for ctx in (b * 512, b * 4096, b * 16384)
    ]
    for s in pre + dec:
        s["seconds"] = float(s["seconds"]) * (1 + noise * rng.standard_normal())
    return {"schema": "mooncake.profile/1", "model": "x", "prefill": pre, "decode": dec}


def test_fit_recovers_a_known_polynomial() -> None:
    doc = json.loads(json.dumps(profile()))  # the JSON round trip the profiler file makes
    model = parse_profile(doc)
    assert model.prefill.coef == pytest.approx(TRUE_PREFILL, rel=1e-6)
    assert model.decode.coef == pytest.approx(TRUE_DECODE, rel=1e-6)
    assert model.prefill.rmse < 1e-9
    assert model.prefill_s(10_000, 2_048) == pytest.approx(true_prefill(10_000, 2_048))


def test_fit_keeps_coefficients_non_negative_under_noise() -> None:
    model = parse_profile(profile(noise=0.05, seed=3))
    assert all(c >= 0 for c in model.prefill.coef + model.decode.coef)
    # Still close to the truth where it matters (a long prompt).
    assert model.prefill_s(16_384, 0) == pytest.approx(true_prefill(16_384, 0), rel=0.1)


def test_fit_learns_what_loading_a_cached_prefix_costs() -> None:
    model = parse_profile(profile(coef=COSTLY_LOAD))
    assert model.prefill.coef == pytest.approx(COSTLY_LOAD, rel=1e-6, abs=1e-15)
    # Loading 3 of 4 k tokens is dearer than computing them; the prediction is the best
    # reuse (here none), so a cached prefill is never predicted slower than a cold one.
    assert true_prefill(4096, 3072, COSTLY_LOAD) > true_prefill(4096, 0, COSTLY_LOAD)
    assert reuse_point(model.prefill, 4096, 3072) == 0.0
    assert model.prefill_s(4096, 3072) == pytest.approx(true_prefill(4096, 0, COSTLY_LOAD))
    # At 128 k the attention a long prefix saves outweighs its loading: it is worth it.
    assert reuse_point(model.prefill, 131_072, 122_880) == 122_880
    assert model.prefill_s(131_072, 122_880) < model.prefill_s(131_072, 0)


def test_reuse_point_is_the_least_of_the_quadratic() -> None:
    # Convex in P (the n² term above the L² - P² one): the least lies inside [0, cached].
    coef = (0.0, 1e-4, 2e-9, 0.0, 1.2e-4)
    model = parse_profile(profile(coef=coef))
    best = reuse_point(model.prefill, 8192, 8000)
    assert 0 < best < 8000
    t = [poly_prefill_s(model.prefill, 8192, c) for c in (0, best, 8000)]
    grid = [true_prefill(8192, p, coef) for p in range(0, 8001, 50)]
    assert t[1] == pytest.approx(min(grid), rel=1e-4)
    assert t[1] <= t[0] and t[1] <= true_prefill(8192, 8000, coef)


def test_reuse_loads_the_fewest_whole_blocks_that_reach_the_least_time() -> None:
    free = parse_profile(profile())
    assert reuse(free, 4096, 3072, 512) == (3072, free.prefill_s(4096, 3072))  # all of it
    costly = parse_profile(profile(coef=COSTLY_LOAD))
    assert reuse(costly, 4096, 3072, 512) == (0, costly.prefill_s(4096, 0))  # recompute it
    convex = parse_profile(profile(coef=(0.0, 1e-4, 2e-9, 0.0, 1.2e-4)))
    got, seconds = reuse(convex, 8192, 7680, 512)
    assert got % 512 == 0 and 0 < got < 7680 and seconds == convex.prefill_s(8192, 7680)
    assert got >= reuse_point(convex.prefill, 8192, 7680) > got - 512
    assert convex.prefill_s(8192, got) == pytest.approx(convex.prefill_s(8192, 7680))
    assert reuse(costly, 4096, 300, 512)[0] == 300  # no whole block: nothing to choose


def test_nonnegative_fit_drops_a_column_the_data_pushes_negative() -> None:
    # y = 2·x0 - 1·x1 unconstrained; the best non-negative fit uses x0 alone.
    rows = [(1.0, 0.0), (1.0, 1.0), (2.0, 1.0), (3.0, 1.0)]
    y = [2.0, 1.0, 3.0, 5.0]
    fit = fit_nonnegative(rows, y)
    assert fit.coef[1] == 0.0 and fit.coef[0] > 0


def test_profile_rejects_bad_samples() -> None:
    doc = profile()
    doc["prefill"] = [{"prompt_tokens": 10, "cached_tokens": 20, "seconds": 1.0}]
    with pytest.raises(ValueError):
        parse_profile(doc)
    with pytest.raises(ValueError):
        parse_profile({**profile(), "schema": "other/9"})


def test_kv_bytes_per_token_of_llama3_70b_is_320_kib() -> None:
    assert LLAMA3_70B.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327_680


def test_analytic_prefill_matches_the_flops_formula() -> None:
    # 8k tokens, no prefix: 80·(4·8192²·8192 + 22·8192·8192²) = 80·26·8192³ = 1.1435e15
    # FLOPs at 0.5 MFU of 8 x 312 TFLOPS = 1.248e15 FLOP/s -> 0.9163 s.
    m = AnalyticCostModel(LLAMA3_70B, A800_X8)
    assert m.prefill_s(8192, 0) == pytest.approx(80 * 26 * 8192**3 / (0.5 * 8 * 312e12))
    assert m.prefill_s(8192, 0) == pytest.approx(0.9163, rel=1e-3)
    assert AnalyticCostModel(LLAMA3_70B, H800_X8).prefill_s(8192, 0) < m.prefill_s(8192, 0)


def test_reuse_pays_off_above_about_6_gb_per_s_at_full_mfu() -> None:
    # PAPER.md §4: per reused token the saved compute (≈ l·b·d² + attention) must outlast the
    # load of 320 KiB; at 100 % MFU on 8xA800 that break-even is ≈ 6-7 GB/s.
    per_token_s = 80 * 22 * 8192**2 / (8 * 312e12)
    assert 5e9 < LLAMA3_70B.kv_bytes_per_token / per_token_s < 8e9


tokens = st.integers(min_value=0, max_value=200_000)
MODELS = [
    AnalyticCostModel(LLAMA3_70B, A800_X8),
    AnalyticCostModel(LLAMA3_70B, H800_X8),
    # A slow host link, where loading a long prefix costs more than recomputing part of it.
    AnalyticCostModel(LLAMA3_70B, A800_X8.__class__("slow", 8, 312e12, 2e12, 2e9, 1e9)),
    parse_profile(profile(noise=0.05, seed=1)),
    parse_profile(profile(noise=0.05, seed=2, coef=COSTLY_LOAD)),
]


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(MODELS), tokens, tokens, st.integers(0, 50_000))
def test_prefill_is_monotone(model: AnalyticCostModel, prompt: int, cached: int, d: int) -> None:
    cached = min(cached, prompt)
    t = model.prefill_s(prompt, cached)
    assert model.prefill_s(prompt + d, cached) >= t  # longer prompt: never faster
    assert model.prefill_s(prompt, min(cached + d, prompt)) <= t  # longer prefix: never slower


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(MODELS), st.integers(0, 512), tokens, st.integers(0, 64), tokens)
def test_decode_step_is_monotone(
    model: AnalyticCostModel, batch: int, ctx: int, db: int, dctx: int
) -> None:
    t = model.decode_step_s(batch, ctx)
    assert model.decode_step_s(batch + db, ctx) >= t
    assert model.decode_step_s(batch, ctx + dctx) >= t


@given(tokens, tokens)
def test_transfer_is_monotone_and_free_when_empty(a: int, b: int) -> None:
    tm = TransferModel.for_hardware(LLAMA3_70B, A800_X8)
    assert tm.transfer_s(0) == 0.0
    lo, hi = sorted((a, b))
    assert tm.transfer_s(lo) <= tm.transfer_s(hi)
    if hi > 0:  # 50 GB/s effective of 100 GB/s, 1 ms latency
        assert tm.transfer_s(hi) == pytest.approx(1e-3 + hi * 327_680 / 50e9)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(MODELS), tokens, tokens, st.sampled_from([16, 256, 512]))
def test_a_chosen_reuse_is_never_predicted_slower_than_a_cold_prefill(
    model: AnalyticCostModel, prompt: int, cached: int, block: int
) -> None:
    cached = min(cached, prompt) // block * block
    used, seconds = reuse(model, prompt, cached, block)
    assert used % block == 0 and 0 <= used <= cached
    t = model.prefill_s(prompt, used)
    assert t <= model.prefill_s(prompt, 0) * (1 + 1e-9)
    assert t <= seconds * (1 + 1e-9) and seconds == model.prefill_s(prompt, cached)

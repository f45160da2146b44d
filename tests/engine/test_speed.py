"""bfloat16 paths are taken where they measure faster here, not wherever the CPU has the
instructions (engine.speed, gemm.bf16_gemms_fast, paged.prefill_kernel)."""

from __future__ import annotations

import math
import time

import pytest
import torch

from mooncake.engine import KVPool, ModelSpec, gemm, native, paged
from mooncake.engine.speed import FASTER, best_ratio, paired, speedup


def test_paired_gives_medians_and_the_median_of_the_pairs_ratios() -> None:
    ours = iter([1.0, 2.0, 3.0, 10.0]).__next__  # the first call of each is the warm-up
    theirs = iter([9.0, 4.0, 2.0, 30.0]).__next__
    a, b, ratio = paired(ours, theirs, 3)
    assert (a, b) == (3.0, 4.0)
    assert ratio == 2.0  # the ratios 2, 2/3, 3


def test_best_ratio_compares_the_least_disturbed_calls_of_each_way() -> None:
    # After the warm-ups, ours is disturbed in two of three calls and theirs in one (the
    # median of the pairs' ratios, 0.4 / 90 / 0.4, would say 0.4x).
    # The warm-ups are the fastest calls of all: they count for nothing.
    ours = iter([0.1, 10.0, 1.0, 10.0]).__next__
    theirs = iter([0.1, 4.0, 90.0, 4.0]).__next__
    assert best_ratio(ours, theirs, 3) == 4.0


def test_speedup_tells_the_faster_of_two_ways() -> None:
    fast, slow = (lambda: time.sleep(0.002)), (lambda: time.sleep(0.02))
    assert speedup(fast, slow, reps=3) > 3
    assert speedup(slow, fast, reps=3) < 1 / 3


@pytest.mark.parametrize(("measured", "taken"), [(None, False), (0.65, False), (FASTER, True),
                                                 (4.0, True)])  # fmt: skip
def test_bf16_gemms_are_taken_only_where_they_measured_faster(
    monkeypatch: pytest.MonkeyPatch, measured: float | None, taken: bool
) -> None:
    monkeypatch.setattr(gemm, "bf16_gemm_speedup", lambda: measured)
    assert gemm.bf16_gemms_fast() is taken


def test_the_bf16_gemm_probe_measures_where_the_instructions_are() -> None:
    measured = gemm.bf16_gemm_speedup()
    if not gemm.bf16_instructions():
        assert measured is None
        return
    assert measured is not None and math.isfinite(measured) and measured > 0


def _pool() -> KVPool:
    spec = ModelSpec(64, 576, 1, 9, 3, 64, 256)  # vocab, hidden, layers, heads, kv_heads..
    return KVPool(spec, torch.float32, torch.device("cpu"), budget_bytes=1 << 20, page_tokens=16)


@pytest.mark.parametrize("measured", [None, 0.6, FASTER * 0.99])
def test_bf16_attention_below_the_bar_takes_the_float32_build(
    monkeypatch: pytest.MonkeyPatch, measured: float | None
) -> None:
    monkeypatch.setattr(paged, "bf16_attention_speedup", lambda dim, page, kv=False: measured)
    kernel = paged.prefill_kernel(_pool(), bf16=True)
    if native.load_prefill(64, 16) is None:
        pytest.skip("no native prefill kernel here (no C compiler)")
    assert kernel is not None and not kernel.bf16
    assert kernel is native.load_prefill(64, 16)


def test_bf16_attention_measured_faster_takes_the_bf16_build(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    build = native.load_prefill(64, 16, bf16=True)
    if build is None or not build.bf16:
        pytest.skip("no bfloat16 prefill build here (AVX512_BF16)")
    monkeypatch.setattr(paged, "bf16_attention_speedup", lambda dim, page, kv=False: FASTER)
    kernel = paged.prefill_kernel(_pool(), bf16=True)
    assert kernel is build and kernel.bf16
    assert not paged.prefill_kernel(_pool()).bf16  # not asked for: float32


def test_the_bf16_attention_probe_measures_where_there_is_a_build() -> None:
    measured = paged.bf16_attention_speedup(64, 16)
    build = native.load_prefill(64, 16, bf16=True)
    if build is None or not build.bf16:
        assert measured is None
        return
    assert measured is not None and math.isfinite(measured) and measured > 0


def test_a_probe_leaves_torch_as_it_found_it() -> None:
    """The probes run under inference mode with their own generator: the global RNG and
    grad mode are untouched (a worker's sampling seeds stay reproducible)."""
    gemm.bf16_gemm_speedup.cache_clear()
    paged.bf16_attention_speedup.cache_clear()
    torch.manual_seed(5)
    want = torch.rand(3)
    torch.manual_seed(5)
    gemm.bf16_gemm_speedup()
    paged.bf16_attention_speedup(64, 16)
    assert torch.equal(torch.rand(3), want)
    assert torch.is_grad_enabled()


def test_bench_engine_reports_what_the_engine_measured() -> None:
    """`bench engine` prints the two probes' ratios (the same cached measurements the engine
    chooses by), null where this CPU has no bfloat16 instructions or build."""
    from mooncake.bench.engine import _bf16_probes
    from mooncake.engine import Engine, dummy_model

    spec = ModelSpec(64, 128, 1, 2, 1, 64, 256)  # head_dim 64
    engine = Engine(dummy_model(spec), block_tokens=16)
    out = _bf16_probes(engine)
    measured = gemm.bf16_gemm_speedup(), paged.bf16_attention_speedup(64, engine.pool.page_tokens)
    want = [None if m is None else round(m, 3) for m in measured]
    assert [out["bf16_gemm_speedup"], out["bf16_attention_speedup"]] == want

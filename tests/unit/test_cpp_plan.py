"""The chunked-pipeline plan and schedule (core.cpp): pure, with the laws it must keep."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mooncake.core.cpp import (
    CppPlan,
    choose_stages,
    chunk_ranges,
    cpp_ttft_s,
    layer_ranges,
    pipeline_finish_s,
)


@given(layers=st.integers(1, 128), stages=st.integers(1, 16))
def test_layer_ranges_cover_every_layer_once_and_evenly(layers: int, stages: int) -> None:
    if stages > layers:
        with pytest.raises(ValueError):
            layer_ranges(layers, stages)
        return
    ranges = layer_ranges(layers, stages)
    assert len(ranges) == stages and ranges[0][0] == 0 and ranges[-1][1] == layers
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    sizes = [e - f for f, e in ranges]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


@given(start=st.integers(0, 5000), n=st.integers(1, 20000), chunk=st.integers(1, 4096))
def test_chunks_cover_the_positions_in_order(start: int, n: int, chunk: int) -> None:
    chunks = chunk_ranges(start, start + n, chunk)
    assert chunks[0][0] == start and chunks[-1][1] == start + n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(chunks))
    assert all(0 < e - f <= chunk for f, e in chunks)


def test_a_pipeline_schedule_worked_out_by_hand() -> None:
    # Two stages, three chunks of 1 s each: the second stage starts at 1, ends at 4.
    assert pipeline_finish_s([[1, 1, 1], [1, 1, 1]]) == 4
    # A hop of 0.5 s per chunk between the stages: each arrival is 0.5 s later.
    assert pipeline_finish_s([[1, 1, 1], [1, 1, 1]], hop_s=0.5) == 4.5
    # A slow second stage is the bottleneck: 1 + 3 x 2.
    assert pipeline_finish_s([[1, 1, 1], [2, 2, 2]]) == 7
    # One stage: the sum.
    assert pipeline_finish_s([[1, 2, 3]]) == 6


@given(
    times=st.lists(st.lists(st.floats(0.01, 5), min_size=3, max_size=3), min_size=1, max_size=5),
    hop=st.floats(0, 1),
)
def test_a_pipeline_never_beats_its_slowest_stage_nor_loses_to_running_it_all_in_a_row(
    times: list[list[float]], hop: float
) -> None:
    finish = pipeline_finish_s(times, hop)
    assert finish >= max(sum(t) for t in times) - 1e-9
    serial = sum(sum(t) for t in times) + hop * (len(times) - 1) * 3
    assert finish <= serial + 1e-9


def quadratic(prompt: int, cached: int) -> float:
    """A prefill whose cost grows with the keys each new token sees (the FLOPs shape of the
    cost model: `prefill_s(prompt_tokens, cached_tokens)`)."""
    new = prompt - cached
    return 1e-4 * new + 1e-9 * new * (prompt + cached)


def test_cpp_ttft_splits_each_chunk_over_the_stages() -> None:
    plan = CppPlan.of(30, 2, 0, 8192, 1024)
    single = quadratic(8192, 0)
    two = cpp_ttft_s(quadratic, plan, 30)
    assert single / 2 < two < single
    # Chunks grow dearer (more keys), so the second stage always waits for the first: it
    # ends half a chunk (its half of the last one) after the first stage ends.
    per_chunk = [quadratic(b, a) for a, b in plan.chunks]
    assert per_chunk == sorted(per_chunk)
    assert two == pytest.approx(sum(per_chunk) / 2 + per_chunk[-1] / 2)


def test_choose_stages_takes_a_group_only_where_it_pays() -> None:
    long = choose_stages(quadratic, start=0, end=32768, model_layers=30, available=4)
    assert long.stages == 4 and long.prefill_s < quadratic(32768, 0) / 3
    short = choose_stages(quadratic, start=0, end=900, model_layers=30, available=4)
    assert short.stages == 1  # one chunk: nothing to pipeline
    # A hop that costs as much as a chunk's compute: not worth a group.
    costly = choose_stages(quadratic, start=0, end=4096, model_layers=30, available=2, hop_s=1.0)
    assert costly.stages == 1
    assert choose_stages(quadratic, start=0, end=32768, model_layers=30, available=1).stages == 1

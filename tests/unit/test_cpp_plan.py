"""The chunked-pipeline plan and schedule (core.cpp): pure, with the laws it must keep."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.core.cpp import (
    CppConfig,
    CppPlan,
    capped,
    choose_group,
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


@given(
    start=st.integers(0, 5000), n=st.integers(1, 40000), chunk=st.integers(16, 4096),
    cap=st.integers(1, 8192),
)  # fmt: skip
def test_capped_chunks_cover_the_same_positions_none_longer_than_the_cap(
    start: int, n: int, chunk: int, cap: int
) -> None:
    chunks = chunk_ranges(start, start + n, chunk, lambda b, a: float(b * b - a * a))
    out = capped(chunks, cap)
    assert out[0][0] == start and out[-1][1] == start + n
    assert all(a[1] == b[0] for a, b in itertools.pairwise(out))
    assert all(0 < e - f <= cap for f, e in out)
    # a chunk that fits is kept as it is; one that does not is cut into the fewest pieces
    assert len(out) == sum(-(-(e - f) // cap) for f, e in chunks)
    assert capped(out, cap) == out


@given(start=st.integers(0, 5000), n=st.integers(1, 40000), chunk=st.integers(64, 4096))
def test_balanced_chunks_cover_the_positions_at_about_equal_cost(
    start: int, n: int, chunk: int
) -> None:
    even = chunk_ranges(start, start + n, chunk)
    chunks = chunk_ranges(start, start + n, chunk, quadratic)
    assert len(chunks) == len(even)
    assert chunks[0][0] == start and chunks[-1][1] == start + n
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in itertools.pairwise(chunks))
    costs = [quadratic(b, a) for a, b in chunks]
    if len(chunks) > 1:
        # Each boundary is the first token past its share: a chunk is off its share by at
        # most one token's cost (the dearest token, the last one) at either end.
        share, token = (
            quadratic(start + n, start) / len(chunks),
            quadratic(start + n, start + n - 1),
        )
        assert all(abs(c - share) <= 2 * token + 1e-12 for c in costs)
        # Later tokens cost more: the chunks shrink (one token of slack at each end).
        sizes = [b - a for a, b in chunks]
        assert all(x + 2 >= y for x, y in itertools.pairwise(sizes))
        # ... so the dearest chunk, the pipeline's drain, costs no more than an even one's.
        assert max(costs) <= max(quadratic(b, a) for a, b in even) + 2 * token


def test_balanced_chunks_of_an_8k_prompt() -> None:
    chunks = chunk_ranges(0, 8192, 1024, quadratic)
    sizes = [b - a for a, b in chunks]
    assert len(sizes) == 8 and sizes[0] > 1024 > sizes[-1]
    plan = CppPlan.of(30, 2, 0, 8192, 1024, quadratic)
    assert plan.chunks == tuple(chunks) and plan.max_chunk_tokens == sizes[0]
    # The drain shrinks: the pipeline ends sooner than with even chunks.
    assert cpp_ttft_s(quadratic, plan, 30) < cpp_ttft_s(
        quadratic, CppPlan.of(30, 2, 0, 8192, 1024), 30
    )


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


IDLE = [(0.0, "p1"), (0.0, "p2"), (0.0, "p3")]


def group(end: int, others=IDLE, *, leader_q: float = 0.0, hop: float = 0.0, **cfg):  # type: ignore[no-untyped-def]
    conf = CppConfig(**{"max_stages": 4, "layers": 32, "min_efficiency": 0.9, **cfg})
    return choose_group(quadratic, conf, start=0, end=end, leader_queue_s=leader_q,
                        others=others, hop_s=hop)  # fmt: skip


def test_choose_group_takes_a_group_only_where_it_pays() -> None:
    long = group(32768)
    assert long is not None and long.stages == 4 and long.members == ("p1", "p2", "p3")
    assert long.queue_s == 0.0 and long.prefill_s < quadratic(32768, 0) / 3
    assert group(900) is None  # one chunk: nothing to pipeline
    # A hop that costs as much as a chunk's compute: not worth a group.
    assert group(4096, hop=1.0) is None
    assert group(32768, others=[]) is None
    assert group(32768, max_stages=1) is None
    # Too few chunks for a pipeline to stay busy: 4 chunks keep 2 stages 4 / (4 + 1) = 0.8
    # busy, 4 stages 4 / (4 + 3) = 0.57.
    assert group(4096) is None
    few = group(4096, min_efficiency=0.75)
    assert few is not None and few.stages == 2
    # Uneven layer ranges idle the lighter stages: 30 layers in 4 (8, 8, 7, 7) lose 1/16.
    assert (g := group(32768, layers=30)) is not None and g.stages == 3


def test_choose_group_waits_for_busy_members_only_where_it_pays() -> None:
    single = quadratic(32768, 0)
    # The least-queued others first; one busy for a while is left out.
    g = group(32768, [(0.0, "p3"), (single, "p1"), (0.0, "p2")])
    assert g is not None and g.members == ("p2", "p3")
    # Everyone else busy for most of the prefill: the wait eats the gain.
    assert group(32768, [(0.9 * single, "p1"), (0.9 * single, "p2")]) is None
    # A leader busy for longer than the prefill and others idle: they would idle until it is
    # free, more of their time than the pipeline saves (efficiency 0.2).
    assert group(32768, leader_q=5.0) is None
    # ... busy for a moment: the gang starts when it is free.
    g = group(32768, leader_q=0.01)
    assert g is not None and g.queue_s == 0.01 and g.stages == 4
    # min_gain binds: a group that is only a little faster is not taken.
    assert group(32768, min_gain=100.0) is None


@settings(max_examples=200, deadline=None)
@given(
    end=st.integers(1, 200_000),
    queues=st.lists(st.floats(0, 100), min_size=0, max_size=7),
    leader_q=st.floats(0, 100),
    hop=st.floats(0, 0.5),
)
def test_a_chosen_group_beats_the_leader_alone_and_keeps_its_workers_busy(
    end: int, queues: list[float], leader_q: float, hop: float
) -> None:
    others = [(q, f"p{i}") for i, q in enumerate(queues)]
    conf = CppConfig(max_stages=8, layers=30)
    g = choose_group(quadratic, conf, start=0, end=end, leader_queue_s=leader_q,
                     others=others, hop_s=hop)  # fmt: skip
    if g is None:
        return
    single = quadratic(end, 0)
    assert leader_q + single >= conf.min_gain * (g.queue_s + g.prefill_s)
    by_id = dict((i, q) for q, i in others)
    assert g.queue_s == max([leader_q, *(by_id[m] for m in g.members)])
    waits = g.queue_s - leader_q + sum(g.queue_s - by_id[m] for m in g.members)
    assert single / (g.stages * g.prefill_s + waits) >= conf.min_efficiency

"""A decode step's thread count, measured per batch size (engine/threads.py)."""

from __future__ import annotations

import torch

from mooncake.engine import threads as th
from mooncake.engine.threads import StepThreads, bucket


def test_buckets_double() -> None:
    assert [bucket(b) for b in (1, 2, 3, 4, 7, 8, 16)] == [1, 2, 2, 3, 3, 4, 5]


def test_each_way_is_measured_then_the_faster_taken_and_the_other_tried_again() -> None:
    s = StepThreads(full=2)
    seen = []
    for _ in range(2 * th.MIN_SAMPLES):  # both ways first, whatever they measure
        way = s.pick(1)
        seen.append(way)
        s.observe(1, way, 0.010 if way == 1 else 0.020)  # one thread faster here
    assert seen.count(1) == seen.count(2) == th.MIN_SAMPLES
    assert s.faster(1) == 1
    picks = []
    for _ in range(4 * th.EXPLORE_EVERY):
        way = s.pick(1)
        picks.append(way)
        s.observe(1, way, 0.010 if way == 1 else 0.020)
    assert picks.count(2) == 4  # one step in EXPLORE_EVERY keeps measuring the other
    # A bigger batch is its own bucket, measured on its own: there two threads win.
    assert s.faster(8) is None
    for _ in range(2 * th.MIN_SAMPLES + 5):
        way = s.pick(8)
        s.observe(8, way, 0.030 if way == 1 else 0.015)
    assert s.faster(8) == 2 and s.pick(8) == 2 and s.faster(1) == 1


def test_a_change_is_followed() -> None:
    """The other way's occasional steps move its average: when it becomes the faster (the
    host got busier, say), it is taken."""
    s = StepThreads(full=2)
    for _ in range(2 * th.MIN_SAMPLES + 3 * th.EXPLORE_EVERY):
        way = s.pick(1)
        s.observe(1, way, 0.010 if way == 2 else 0.018)
    assert s.faster(1) == 2
    for _ in range(8 * th.EXPLORE_EVERY):
        way = s.pick(1)
        s.observe(1, way, 0.025 if way == 2 else 0.018)  # two threads now slowed down
    assert s.faster(1) == 1 and s.pick(1) == 1


def test_where_it_does_not_apply_the_engine_keeps_its_threads() -> None:
    for s in (StepThreads(full=2, applies=False), StepThreads(full=1)):
        assert not s.applies and s.pick(1) == s.full
        with s.step(1):
            pass
        assert s.faster(1) is None


def test_a_step_runs_on_the_picked_count_and_gives_the_engines_back() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        s = StepThreads()  # torch's count, read at each step
        inside = []
        for _ in range(2 * th.MIN_SAMPLES):
            with s.step(3):
                inside.append(torch.get_num_threads())
            assert torch.get_num_threads() == 2
        assert sorted(set(inside)) == [1, 2]
    finally:
        torch.set_num_threads(before)


def test_a_fused_steps_tokens_do_not_depend_on_its_thread_count(engine: object) -> None:
    """Why a step may take either count: the fused step over quantized weights gives each
    output to one thread, so one thread and two give the same tokens, step by step."""
    from mooncake.engine import DecodeBatch, Engine, SamplingParams

    assert isinstance(engine, Engine)
    if engine.decode_path != "fused" or not engine.step_threads.applies:
        import pytest

        pytest.skip(f"decode path {engine.decode_path}, {torch.get_num_threads()} threads")
    before = torch.get_num_threads()
    outs = []
    try:
        for fixed in (1, 2):
            torch.set_num_threads(2)
            batch = DecodeBatch(engine)
            for j in range(3):
                prefilled = engine.prefill([(11 * i + j) % 5000 + 7 for i in range(40 + 9 * j)])
                batch.add(f"s{j}", prefilled, SamplingParams(max_tokens=12, stop_on_eos=False))
            s = engine.step_threads
            s.pick = lambda batch, fixed=fixed: fixed  # type: ignore[method-assign]
            done = []
            while len(done) < 3:
                done += batch.step()
            outs.append(sorted((c.id, c.tokens) for c in done))
    finally:
        del engine.step_threads.pick
        torch.set_num_threads(before)
    assert outs[0] == outs[1]

"""The trace loader and token synthesis, checked against the traces' README figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mooncake.trace import TraceError, load_trace, request_tokens, reuse_ratio

from helpers import SHARED_TRACES as TRACES
from helpers import TRACE_HEAD

needs_traces = pytest.mark.skipif(
    not (TRACES / "conversation_trace.jsonl").exists(), reason="../shared/traces not present"
)


@needs_traces
@pytest.mark.parametrize(
    ("name", "count", "unbounded", "lru_5859"),
    [("conversation", 12031, 0.374, 0.138), ("synthetic", 3993, 0.651, 0.315)],
)
def test_reuse_ratios_match_the_measured_ones(
    name: str, count: int, unbounded: float, lru_5859: float
) -> None:
    reqs = load_trace(TRACES / f"{name}_trace.jsonl")
    assert len(reqs) == count
    # The README counts a hit on the trailing partial block too.
    assert reuse_ratio(reqs, partial_blocks=True) == pytest.approx(unbounded, abs=0.0005)
    assert reuse_ratio(reqs, 5859, partial_blocks=True) == pytest.approx(lru_5859, abs=0.0005)
    whole_only = reuse_ratio(reqs)
    assert unbounded - 0.01 < whole_only <= reuse_ratio(reqs, partial_blocks=True)


def _reference_reuse(path: Path, capacity: int | None) -> float:
    """The reuse ratio straight from the JSON lines, partial blocks counted, with the LRU as
    a plain list (most recent last): slow, obvious, independent of `mooncake.trace`."""
    lru: list[int] = []
    reused = total = 0
    for line in path.read_text().splitlines():
        r = json.loads(line)
        hit = 0
        while hit < len(r["hash_ids"]) and r["hash_ids"][hit] in lru:
            hit += 1
        reused += min(512 * hit, r["input_length"])
        total += r["input_length"]
        for h in r["hash_ids"]:
            if h in lru:
                lru.remove(h)
            lru.append(h)
        while capacity is not None and len(lru) > capacity:
            lru.pop(0)
    return reused / total


@pytest.mark.parametrize("capacity", [None, 50, 400])
def test_reuse_ratio_on_the_packaged_head_equals_a_reference(capacity: int | None) -> None:
    """Runs everywhere (the head ships in the package), unlike the README figures above."""
    reqs = load_trace(TRACE_HEAD)
    assert len(reqs) == 200
    want = _reference_reuse(TRACE_HEAD, capacity)
    assert 0 < want < 1
    assert reuse_ratio(reqs, capacity, partial_blocks=True) == pytest.approx(want, abs=1e-12)


def test_tokens_follow_hash_ids_and_scale(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [7, 8]}\n'
        '{"timestamp": 1500, "input_length": 600, "output_length": 5, "hash_ids": [7, 9]}\n'
    )
    a, b = load_trace(path)
    assert b.arrival_s == 1.5
    ta = request_tokens(a, vocab_size=100, tokens_per_block=16)
    tb = request_tokens(b, vocab_size=100, tokens_per_block=16)
    assert len(ta) == 32 and len(tb) == 19  # ceil(1000*16/512), ceil(600*16/512)
    assert ta[:16] == tb[:16] and ta[16:] != tb[16:19]
    assert ta == request_tokens(a, vocab_size=100, tokens_per_block=16)
    assert all(0 <= t < 100 for t in ta)


@pytest.mark.parametrize(
    "line",
    [
        "not json",
        '{"timestamp": 0, "input_length": 10, "output_length": 1}',
        '{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [1]}',
        '{"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [1]}',
    ],
)
def test_bad_lines_are_reported_with_their_line_number(tmp_path: Path, line: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n' + line + "\n"
    )
    with pytest.raises(TraceError, match=r"bad.jsonl:2"):
        load_trace(path)

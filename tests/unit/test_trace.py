"""The trace loader and token synthesis, checked against the traces' README figures; where
the traces are found (shipped, MOONCAKE_TRACES, --traces), plain or gzipped."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mooncake.cli import app
from mooncake.config import Settings
from mooncake.trace import (
    SHIPPED_TRACES,
    TRACE_NAMES,
    TraceError,
    load_trace,
    request_tokens,
    reuse_ratio,
    trace_path,
    traces_dir,
)

from helpers import TRACE_HEAD, small_traces


@pytest.mark.parametrize(
    ("name", "count", "unbounded", "lru_5859"),
    [("conversation", 12031, 0.374, 0.138), ("synthetic", 3993, 0.651, 0.315)],
)
def test_reuse_ratios_match_the_measured_ones(
    name: str, count: int, unbounded: float, lru_5859: float
) -> None:
    reqs = load_trace(trace_path(name))
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
    """The whole traces are too long for this reference's list LRU; their head is not."""
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


def test_a_gzipped_trace_loads_the_same_requests_as_the_plain_one(tmp_path: Path) -> None:
    packed = tmp_path / "head.jsonl.gz"
    packed.write_bytes(gzip.compress(TRACE_HEAD.read_bytes()))
    assert load_trace(packed) == load_trace(TRACE_HEAD)
    assert load_trace(packed, limit=7) == load_trace(TRACE_HEAD, limit=7)
    # The shipped whole trace starts with the shipped head.
    assert load_trace(trace_path("conversation"), limit=200) == load_trace(TRACE_HEAD)


def test_a_cut_gzip_file_is_a_trace_error_naming_it(tmp_path: Path) -> None:
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gzip.compress(TRACE_HEAD.read_bytes())[:5000])
    with pytest.raises(TraceError, match=r"cut.jsonl.gz: not a whole gzip file"):
        load_trace(cut)


def test_the_shipped_traces_are_found_without_any_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MOONCAKE_TRACES", raising=False)
    assert traces_dir() == traces_dir(settings=Settings(_env_file=None)) == SHIPPED_TRACES
    for name in TRACE_NAMES:
        assert trace_path(name) == SHIPPED_TRACES / f"{name}_trace.jsonl.gz"


def test_mooncake_traces_names_the_directory_and_traces_overrides_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mine = small_traces(tmp_path / "mine", 5)
    # Each trace may be plain or gzipped: synthetic only gzipped, conversation both ways
    # (the plain file is the one read).
    for name in TRACE_NAMES:
        plain = mine / f"{name}_trace.jsonl"
        (mine / f"{name}_trace.jsonl.gz").write_bytes(gzip.compress(plain.read_bytes()))
    (mine / "synthetic_trace.jsonl").unlink()
    monkeypatch.setenv("MOONCAKE_TRACES", str(mine))
    settings = Settings(_env_file=None)
    assert settings.traces == mine
    assert traces_dir(settings=settings) == mine
    assert trace_path("conversation", settings=settings) == mine / "conversation_trace.jsonl"
    synthetic = trace_path("synthetic", settings=settings)
    assert synthetic == mine / "synthetic_trace.jsonl.gz"
    assert load_trace(synthetic) == load_trace(trace_path("synthetic"), limit=5)
    # A command's --traces comes before the setting.
    other = shutil.copytree(mine, tmp_path / "other")
    assert traces_dir(other, settings=settings) == other


def test_bench_conductor_reads_the_traces_mooncake_traces_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the CLI: one request of one block in each trace indexes exactly 2 blocks (the
    shipped traces would index about 226k), so the setting reached the bench."""
    mine = tmp_path / "mine"
    mine.mkdir()
    for name in TRACE_NAMES:
        (mine / f"{name}_trace.jsonl").write_text(
            '{"timestamp": 0, "input_length": 100, "output_length": 5, "hash_ids": [0]}\n'
        )
    monkeypatch.setenv("MOONCAKE_TRACES", str(mine))
    args = ["bench", "conductor", "--requests", "20", "--instances", "2", "--min-blocks", "1"]
    res = CliRunner().invoke(app, [*args, "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout.splitlines()[-1])["indexed_blocks"] == 2


@pytest.mark.parametrize("command", [["simulate", "paper", "--quick"], ["bench", "conductor"]])
def test_a_traces_directory_without_the_traces_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: list[str]
) -> None:
    (tmp_path / "conversation_trace.jsonl").write_bytes(TRACE_HEAD.read_bytes())
    monkeypatch.setenv("MOONCAKE_TRACES", str(tmp_path))
    with pytest.raises(TraceError) as caught:
        traces_dir(settings=Settings(_env_file=None))
    message = str(caught.value)
    assert f"MOONCAKE_TRACES={tmp_path}" in message
    assert "synthetic_trace.jsonl" in message and "conversation_trace.jsonl[" not in message
    # The commands say the same and exit 2, without a traceback and before any work.
    res = CliRunner().invoke(app, command)
    assert res.exit_code == 2, res.output
    assert str(tmp_path) in res.output and "synthetic_trace.jsonl" in res.output
    assert "Traceback" not in res.output
    # A MOONCAKE_TRACES that names no directory at all is as clear.
    monkeypatch.setenv("MOONCAKE_TRACES", str(tmp_path / "absent"))
    res = CliRunner().invoke(app, command)
    assert res.exit_code == 2 and "not a directory" in res.output, res.output

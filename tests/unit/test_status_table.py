"""`mooncake up`'s status table: one row per component, live figures per worker."""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console

from mooncake.config import Settings
from mooncake.serving.conductor_feed import index_report
from mooncake.stack import INDEX_STALE_S, Stack, WorkerProcess, _duration, index_cells, status_table
from mooncake.store.kv_index import IndexState


def test_duration_reads_as_minutes_then_hours() -> None:
    assert _duration(5) == "0m05s"
    assert _duration(125) == "2m05s"
    assert _duration(3 * 3600 + 7 * 60 + 9) == "3h07m"


def test_rows_show_running_and_exited_workers_with_memory(tmp_path: Path) -> None:
    stack = Stack(Settings(data_dir=tmp_path))
    stack.nats_url, stack.database_url = "nats://x:1", "postgresql://y"
    alive = WorkerProcess(
        "sleeper-0", [sys.executable, "-c", "import time; time.sleep(30)"],
        tmp_path / "a.log", 0, role="sleeper", restarts=2,
    )  # fmt: skip
    gone = WorkerProcess(
        "quitter-0", [sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "b.log", 0,
        role="quitter",
    )  # fmt: skip
    for w in (alive, gone):
        w.spawn()
        stack.workers.append(w)
    assert gone.proc is not None and gone.proc.wait(10) == 3
    try:
        rows = {r[0]: r for r in stack.status_rows()}
        assert rows["nats"][1] == "nats://x:1" and rows["postgres"][2] == "external"
        _, where, state, up, restarts, memory, index = rows["sleeper-0"]
        assert state == "running" and where.startswith("pid ") and restarts == "2"
        assert memory.endswith(" MiB") and float(memory.split()[0]) > 1
        assert up.endswith("s") and index == "-"  # no watch: the index is unknown
        assert rows["quitter-0"][2] == "exited 3" and rows["quitter-0"][5] == "-"
        out = Console(width=200, record=True)
        out.print(status_table(stack))
        text = out.export_text()
        assert "sleeper-0" in text and "restarts" in text and "exited 3" in text
        assert "index" in text
    finally:
        alive.stop(timeout=5)


def test_index_cells_say_each_nodes_state_and_for_how_long_on_the_conductors_clock() -> None:
    # The Conductor's clock runs far from ours: only its own differences count.
    at = 1_000_000.0
    report = index_report(
        {
            "prefill-0": (IndexState.EXACT, at - 182.0),
            "decode-0": (IndexState.RESYNCING, at - 0.4),
            "decode-1": (IndexState.DEGRADED, at - 3 * 3600 - 61),
        },
        {"prefill-0": (IndexState.RESYNCING, at)},  # engine tiers: not the store node's
        at,
    )
    assert [n.node_id for n in report.nodes] == ["decode-0", "decode-1", "prefill-0"]
    assert index_cells(report, 0.0) == {
        "prefill-0": "exact 3m02s",
        "decode-0": "resyncing 0m00s",
        "decode-1": "degraded 3h01m",
    }
    # Received 2 s ago: every state has lasted 2 s longer (as far as anybody knows).
    assert index_cells(report, 2.0)["decode-0"] == "resyncing 0m02s"
    # A report too old to stand for now (the Conductor stopped answering): nothing known.
    assert index_cells(report, INDEX_STALE_S + 0.1) == {}
    # A `since` ahead of `at` (a state entered while the answer was built) is no negative age.
    ahead = index_report({"n": (IndexState.EXACT, at + 1)}, {}, at)
    assert index_cells(ahead, 0.0) == {"n": "exact 0m00s"}

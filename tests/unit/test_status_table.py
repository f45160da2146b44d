"""`mooncake up`'s status table: one row per component, live figures per worker."""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console

from mooncake.config import Settings
from mooncake.stack import Stack, WorkerProcess, _duration, status_table


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
        _, where, state, up, restarts, memory = rows["sleeper-0"]
        assert state == "running" and where.startswith("pid ") and restarts == "2"
        assert memory.endswith(" MiB") and float(memory.split()[0]) > 1
        assert up.endswith("s")
        assert rows["quitter-0"][2] == "exited 3" and rows["quitter-0"][5] == "-"
        out = Console(width=200, record=True)
        out.print(status_table(stack))
        text = out.export_text()
        assert "sleeper-0" in text and "restarts" in text and "exited 3" in text
    finally:
        alive.stop(timeout=5)

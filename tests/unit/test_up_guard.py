"""`mooncake up` and the runtime.env it leaves for `submit`: a live `up` is refused a twin, a
killed one's file is stale (`stack.running_up`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mooncake.stack import running_up


def _env_file(tmp_path: Path, pid: object) -> Path:
    path = tmp_path / "runtime.env"
    path.write_text(f"MOONCAKE_NATS_URL=nats://127.0.0.1:1\nMOONCAKE_UP_PID={pid}\n")
    return path


def test_a_live_up_is_found_and_a_dead_ones_file_is_stale(tmp_path: Path) -> None:
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert running_up(_env_file(tmp_path, other.pid)) == other.pid
    finally:
        other.kill()
        other.wait()
    assert running_up(_env_file(tmp_path, other.pid)) is None  # it was killed
    assert running_up(_env_file(tmp_path, os.getpid())) is None  # this very process
    assert running_up(_env_file(tmp_path, "not-a-pid")) is None
    (tmp_path / "runtime.env").write_text("MOONCAKE_NATS_URL=nats://127.0.0.1:1\n")  # older
    assert running_up(tmp_path / "runtime.env") is None
    assert running_up(tmp_path / "absent.env") is None

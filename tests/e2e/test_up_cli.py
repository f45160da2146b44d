"""`mooncake up` on the embedded default (no broker reachable, no database URL): it starts
nats-server and Postgres itself, migrates, runs the workers; `mooncake submit` in another
process finds it and gets an answer; Ctrl-C stops everything cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mooncake.services import free_port, tcp_reachable
from mooncake.stack import LAYOUT

pytestmark = pytest.mark.e2e


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_")}
    # A port where nothing listens: `up` must start its own broker.
    env["MOONCAKE_NATS_URL"] = f"nats://127.0.0.1:{free_port()}"
    return env


def _mooncake(*args: str) -> list[str]:
    return [sys.executable, "-m", "mooncake.cli", *args]


def test_up_submit_and_clean_shutdown(tmp_path: Path) -> None:
    env = _env()
    up = subprocess.Popen(
        _mooncake("up"), cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    runtime = tmp_path / ".mooncake" / "runtime.env"
    try:
        deadline = time.monotonic() + 180  # embedded Postgres initdb is slow on a busy box
        while not runtime.exists() and time.monotonic() < deadline and up.poll() is None:
            time.sleep(0.2)
        assert runtime.exists(), "mooncake up did not come up"
        urls = dict(line.split("=", 1) for line in runtime.read_text().splitlines())
        # The broker it started serves the configured (local, free) address.
        assert urls["MOONCAKE_NATS_URL"] == env["MOONCAKE_NATS_URL"]
        assert urls["MOONCAKE_DATABASE_URL"].startswith("postgresql+psycopg://postgres@127.0.0.1")
        # The second terminal: no flags, it reads .mooncake/runtime.env.
        sub_env = {k: v for k, v in env.items() if k != "MOONCAKE_NATS_URL"}
        answer = ""
        tries_until = time.monotonic() + 90
        while time.monotonic() < tries_until:  # the workers may still be starting
            res = subprocess.run(
                _mooncake(
                    "submit", "What is the capital of France?", "--timeout", "20",
                    "--until", "admitted",
                ),
                cwd=tmp_path, env=sub_env, capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            answer = res.stdout + res.stderr
            if "admitted" in answer:
                break
            time.sleep(1)  # `submit` fails within seconds while no Conductor takes requests
        assert "admitted" in answer, answer
        # The whole answer: its text in token order, then how it finished.
        whole = subprocess.run(
            _mooncake("submit", "Name three colors.", "--max-tokens", "12", "--timeout", "60"),
            cwd=tmp_path, env=sub_env, capture_output=True, text=True, timeout=90,
        )  # fmt: skip
        lines = whole.stdout.strip().splitlines()
        assert whole.returncode == 0 and lines[-1] in ("-- length", "-- stop"), whole.stdout
        assert "admitted" in lines[0] and "".join(lines[1:-1]).strip(), whole.stdout
        bad = subprocess.run(
            _mooncake("submit", "   "), cwd=tmp_path, env=sub_env, capture_output=True, text=True
        )
        assert bad.returncode == 2 and "empty" in bad.stderr
        # A second `up` in the same directory is refused: it would take over runtime.env.
        twin = subprocess.run(
            _mooncake("up"), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
        )
        assert twin.returncode == 1 and "already runs here" in twin.stderr, twin.stderr
        assert runtime.exists()
    finally:
        up.send_signal(signal.SIGINT)
        out, _ = up.communicate(timeout=60)
    text = out.decode(errors="replace")
    assert up.returncode == 0, text
    assert "stopped" in text
    # Not a terminal: the status table was printed at start (and again at the stop), with
    # every worker's metrics endpoint, and no address cut short.
    assert text.count("component") == 2, text
    workers = sum(n for _, n in LAYOUT)
    assert text.count("metrics http://127.0.0.1:") >= 2 * workers, text
    assert "…" not in text, text
    assert not runtime.exists(), "runtime.env must go when the system stops"
    nats_port = int(urls["MOONCAKE_NATS_URL"].rsplit(":", 1)[1])
    assert not tcp_reachable("127.0.0.1", nats_port), "the embedded broker must be stopped"

"""`mooncake.stack.Stack` beyond `mooncake up`'s defaults, as the benches use it: another
layout, settings built in code (not inherited from the shell), one role's own environment
kept across restarts, and what the processes use."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from mooncake.config import SLO, EngineSettings, Settings
from mooncake.cpus import available
from mooncake.services import ManagedProcess
from mooncake.stack import LAYOUT, Stack, WorkerProcess

SMALL = (("conductor", 1), ("prefill", 1), ("decode", 2))
SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


@pytest.fixture
def sleepers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers are sleeping Pythons, not `mooncake worker ROLE`: what the stack does with
    its processes is under test, not the roles."""

    def spawn(self: WorkerProcess) -> None:
        self.argv = SLEEP
        ManagedProcess.spawn(self)

    monkeypatch.setattr(WorkerProcess, "spawn", spawn)


def test_the_default_layout_is_ups_and_engine_workers_follow_the_layout(tmp_path: Path) -> None:
    up = Stack(Settings(data_dir=tmp_path))
    assert up.layout == LAYOUT and up.engine_workers == 2
    assert up.child_env()["MOONCAKE_ENGINE_WORKERS_PER_HOST"] == "2"
    small = Stack(Settings(data_dir=tmp_path), layout=SMALL)
    assert small.engine_workers == 3
    assert small.child_env()["MOONCAKE_ENGINE_WORKERS_PER_HOST"] == "3"
    assert Stack(Settings(data_dir=tmp_path), layout=(("recorder", 1),)).engine_workers == 1


def test_settings_built_in_code_reach_the_workers_and_the_shell_only_when_inherited(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MOONCAKE_ENGINE__DUMMY__HIDDEN", "128")
    settings = Settings(
        data_dir=tmp_path,
        log_level="WARNING",
        slo=SLO(ttft_s=2.0, tbt_s=0.25),
        engine=EngineSettings(model="dummy"),
    )
    env = Stack(settings, inherit_env=False).child_env()
    assert env["MOONCAKE_ENGINE__MODEL"] == "dummy" and env["MOONCAKE_LOG_LEVEL"] == "WARNING"
    assert (env["MOONCAKE_SLO__TTFT_S"], env["MOONCAKE_SLO__TBT_S"]) == ("2.0", "0.25")
    assert env["MOONCAKE_DATA_DIR"] == str(tmp_path)
    # The dummy model's shape is the settings' (the workers must run the model the caller
    # built), never the shell's, inherited or not.
    assert env["MOONCAKE_ENGINE__DUMMY__HIDDEN"] == "64" and env["PATH"]
    assert env["MOONCAKE_ENGINE__THREADS"] == str(len(available()))
    inherited = Stack(settings).child_env()
    assert inherited["MOONCAKE_ENGINE__DUMMY__HIDDEN"] == "64"
    monkeypatch.setenv("MOONCAKE_SOMETHING_ELSE", "x")  # the rest of the shell is inherited
    assert Stack(settings).child_env()["MOONCAKE_SOMETHING_ELSE"] == "x"
    assert "MOONCAKE_SOMETHING_ELSE" not in Stack(settings, inherit_env=False).child_env()


def test_a_roles_env_is_its_own_and_a_restart_stops_the_running_one_and_keeps_it(
    tmp_path: Path, sleepers: None
) -> None:
    stack = Stack(Settings(data_dir=tmp_path, admission_policy="none"), layout=SMALL)
    stack.role_env["conductor"] = {"MOONCAKE_ADMISSION_POLICY": "early"}
    stack.start_workers()
    try:
        assert [w.name for w in stack.workers] == ["conductor-0", "prefill-0", "decode-0",
                                                   "decode-1"]  # fmt: skip
        old = stack.worker("conductor-0")
        assert old.env is not None and old.env["MOONCAKE_ADMISSION_POLICY"] == "early"
        prefill_env = stack.worker("prefill-0").env
        assert prefill_env is not None and prefill_env["MOONCAKE_ADMISSION_POLICY"] == "none"
        assert stack.dead() == []

        stack.role_env["conductor"] = {"MOONCAKE_ADMISSION_POLICY": "predicted"}
        fresh = stack.restart(old)
        assert not old.running and fresh.running and fresh.restarts == 1
        assert fresh.env is not None and fresh.env["MOONCAKE_ADMISSION_POLICY"] == "predicted"
        assert stack.worker("conductor-0") is fresh

        fresh.kill()
        assert stack.dead() == ["conductor-0"]
        again = stack.restart(fresh)  # after a crash (`mooncake up`'s supervisor): the same env
        assert again.env is not None and again.env["MOONCAKE_ADMISSION_POLICY"] == "predicted"
        assert again.restarts == 2 and stack.dead() == []
    finally:
        stack.stop()


def test_usage_covers_every_running_worker_and_the_extra_processes(
    tmp_path: Path, sleepers: None
) -> None:
    broker = ManagedProcess("nats-server", SLEEP, tmp_path / "broker.log", 0)
    broker.spawn()
    stack = Stack(Settings(data_dir=tmp_path), layout=SMALL, extra={"nats-server": broker})
    stack.start_workers()
    try:
        stack.worker("decode-1").kill()
        # A process just spawned may still be exec-ing its interpreter (under 1 MiB resident:
        # CI once read one so): measure once every sleeper runs, within 10 s.
        deadline = time.monotonic() + 10
        while True:
            used = stack.usage()
            if all(u.rss_bytes > 1 << 20 for u in used.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert set(used) == {"conductor-0", "prefill-0", "decode-0", "nats-server"}
        assert all(u.rss_bytes > 1 << 20 and u.cpu_s >= 0 for u in used.values())
        assert stack.worker("prefill-0").rss_mb() == pytest.approx(
            used["prefill-0"].rss_bytes / (1 << 20), rel=0.5
        )
        logs = stack.log_text()
        assert set(logs) == {"conductor-0", "prefill-0", "decode-0", "decode-1"}
        assert stack.worker("decode-0").log_path.parent == stack.log_dir
    finally:
        stack.stop()
        assert broker.running  # the stack does not stop what it did not start
        broker.stop(timeout=5)

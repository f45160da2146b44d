"""The vLLM peer's plumbing, without vLLM: the availability probe, the export's marker logic,
readiness and failure reporting, and that stop() really ends a process group, children too."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from mooncake.bench import vllm_peer as vp


def fake_python(tmp: Path, body: str) -> Path:
    """An executable standing in for the anchors interpreter: a shell script."""
    exe = tmp / "python"
    exe.write_text("#!/bin/sh\n" + body + "\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe


def test_available_reports_a_missing_interpreter(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "python"
    reason = vp.available(missing)
    assert reason is not None
    assert str(missing) in reason


def test_available_reports_a_failed_import(tmp_path: Path) -> None:
    py = fake_python(tmp_path, 'echo "ModuleNotFoundError: No module named vllm" >&2; exit 1')
    reason = vp.available(py)
    assert reason is not None and "No module named vllm" in reason


def test_available_accepts_an_interpreter_whose_import_works(tmp_path: Path) -> None:
    assert vp.available(fake_python(tmp_path, "echo 0.32.0")) is None


def test_available_times_out(tmp_path: Path) -> None:
    reason = vp.available(fake_python(tmp_path, "exec sleep 30"), timeout_s=0.5)
    assert reason is not None and "took over" in reason


def gguf_file(tmp: Path, size: int = 1000) -> Path:
    g = tmp / "m.gguf"
    g.write_bytes(b"G" * size)
    return g


def test_export_is_skipped_when_the_marker_matches(tmp_path: Path) -> None:
    gguf = gguf_file(tmp_path)
    out = tmp_path / "hf"
    out.mkdir()
    (out / vp.MARKER).write_text(json.dumps({"gguf": str(gguf), "gguf_bytes": 1000}))
    # An interpreter that would fail if run: the skip must not run it.
    py = fake_python(tmp_path, "touch ran; exit 1")
    assert vp.export_model(py, gguf, out, timeout_s=10) == out.absolute()
    assert not (tmp_path / "ran").exists() and not (out / "ran").exists()


def test_export_refuses_a_marker_for_another_file(tmp_path: Path) -> None:
    gguf = gguf_file(tmp_path)
    out = tmp_path / "hf"
    out.mkdir()
    (out / vp.MARKER).write_text(json.dumps({"gguf": str(gguf), "gguf_bytes": 999}))
    with pytest.raises(vp.PeerError, match="holds an export of"):
        vp.export_model(fake_python(tmp_path, "exit 0"), gguf, out, timeout_s=10)


def test_export_runs_the_script_and_renames_into_place(tmp_path: Path) -> None:
    gguf = gguf_file(tmp_path)
    out = tmp_path / "hf"
    # Stands in for _vllm_export.py: argv is SCRIPT GGUF OUT_DIR MARKER.
    py = fake_python(
        tmp_path,
        'echo weights > "$3/model.safetensors"\n'
        'printf \'{"gguf": "%s", "gguf_bytes": 1000}\' "$2" > "$3/$4"',
    )
    assert vp.export_model(py, gguf, out, timeout_s=10) == out.absolute()
    assert (out / "model.safetensors").read_text() == "weights\n"
    assert vp.export_done(out, gguf)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".hf.")] == []


def test_a_failed_export_raises_with_stderr_and_leaves_nothing(tmp_path: Path) -> None:
    gguf = gguf_file(tmp_path)
    out = tmp_path / "hf"
    py = fake_python(tmp_path, 'echo partial > "$3/config.json"; echo "boom: no gguf" >&2; exit 3')
    with pytest.raises(RuntimeError, match="boom: no gguf") as err:
        vp.export_model(py, gguf, out, timeout_s=10)
    assert "exit 3" in vp.peer_error(err.value)
    assert not out.exists()
    assert sorted(tmp_path.iterdir()) == sorted([gguf, py])  # no temporary directory left


def test_an_export_without_its_marker_is_a_failure(tmp_path: Path) -> None:
    gguf = gguf_file(tmp_path)
    with pytest.raises(vp.PeerError, match="failed"):
        vp.export_model(fake_python(tmp_path, "exit 0"), gguf, tmp_path / "hf", timeout_s=10)


def test_export_will_not_overwrite_an_unfinished_directory(tmp_path: Path) -> None:
    gguf = gguf_file(tmp_path)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("{}")
    with pytest.raises(vp.PeerError, match="not a finished export"):
        vp.export_model(fake_python(tmp_path, "exit 0"), gguf, out, timeout_s=10)


class FakeServer(vp.VllmServer):
    """VllmServer's process handling around a command of the test's choosing."""

    def __init__(self, argv: list[str], port: int, log_dir: Path) -> None:
        super().__init__(python=Path(sys.executable), model_dir=log_dir, port=port, log_dir=log_dir)
        self.argv = argv

    def command(self) -> list[str]:
        return self.argv


def gone(pid: int) -> bool:
    """Whether `pid` has exited (a zombie waiting to be reaped by init counts as exited)."""
    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# A parent that ignores SIGTERM, with two children: one ignoring SIGTERM too, one not.
STUBBORN_TREE = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
kids = [subprocess.Popen([sys.executable, "-c", stubborn]),
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])]
print("kids", *[k.pid for k in kids], flush=True)
time.sleep(600)
"""


def test_stop_kills_the_whole_process_group(tmp_path: Path) -> None:
    srv = FakeServer([sys.executable, "-c", STUBBORN_TREE], free_port(), tmp_path)
    srv.start()
    root = srv.pid
    assert root is not None
    deadline = time.monotonic() + 20
    while "kids" not in srv.log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    kids = [int(x) for x in srv.log_path.read_text().split("kids", 1)[1].split()[:2]]
    assert all(psutil.pid_exists(k) for k in kids)
    assert os.getpgid(kids[0]) == root  # the server leads its own group
    rss = srv.rss_bytes()
    assert rss is not None and rss > 3 * 1_000_000  # three interpreters' worth
    t0 = time.monotonic()
    srv.stop(grace_s=1.0)
    assert time.monotonic() - t0 < 15
    assert srv.pid is None
    assert [k for k in kids if not gone(k)] == []
    srv.stop()  # a second stop is harmless


def test_context_manager_stops_a_tree_that_honours_sigterm(tmp_path: Path) -> None:
    code = "import subprocess, sys, time; subprocess.Popen(['sleep', '600']); time.sleep(600)"
    with FakeServer([sys.executable, "-c", code], free_port(), tmp_path) as srv:
        root = srv.pid
        assert root is not None
        deadline = time.monotonic() + 20
        while not psutil.Process(root).children() and time.monotonic() < deadline:
            time.sleep(0.05)
        kids = psutil.Process(root).children(recursive=True)
        assert kids
    _, alive = psutil.wait_procs(kids, timeout=5)
    assert [p for p in alive if p.status() != psutil.STATUS_ZOMBIE] == []


def test_wait_ready_reports_an_early_exit_with_the_log(tmp_path: Path) -> None:
    code = "import sys; print('ValueError: no CPU backend here'); sys.exit(7)"
    with FakeServer([sys.executable, "-c", code], free_port(), tmp_path) as srv:
        with pytest.raises(vp.PeerError) as err:
            srv.wait_ready(timeout_s=30)
    assert "exit 7" in err.value.reason
    assert "no CPU backend here" in str(err.value)
    assert vp.peer_error(err.value).endswith("ValueError: no CPU backend here")


def test_wait_ready_times_out(tmp_path: Path) -> None:
    code = "import time; time.sleep(600)"
    with FakeServer([sys.executable, "-c", code], free_port(), tmp_path) as srv:
        t0 = time.monotonic()
        with pytest.raises(vp.PeerError, match="not ready within 1 s"):
            srv.wait_ready(timeout_s=1)
        assert time.monotonic() - t0 < 10


def test_wait_ready_sees_v1_models_answer(tmp_path: Path) -> None:
    root = tmp_path / "www"
    (root / "v1").mkdir(parents=True)
    (root / "v1" / "models").write_text('{"data": []}')
    port = free_port()
    argv = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
    argv += ["--directory", str(root)]
    with FakeServer(argv, port, tmp_path / "logs") as srv:
        assert srv.wait_ready(timeout_s=30) < 30
        assert srv.url == f"http://127.0.0.1:{port}"


def test_the_command_and_environment() -> None:
    srv = vp.VllmServer(
        python=Path("/x/bin/python"),
        model_dir=Path("/m"),
        port=9000,
        log_dir=Path("/l"),
        cpus="0-1",
        kv_space_gib=4,
        max_model_len=4096,
        tcmalloc=Path("/lib/libtcmalloc_minimal.so.4"),
    )
    cmd = srv.command()
    assert cmd[:3] == ["/x/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--max-model-len") + 1] == "4096"
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16"
    assert cmd[cmd.index("--port") + 1] == "9000"
    env = srv.env()
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert env["LD_PRELOAD"].split(":")[0] == "/lib/libtcmalloc_minimal.so.4"
    assert "PYTHONPATH" not in env


def test_peer_error_is_one_short_line() -> None:
    long = vp.PeerError("vLLM not ready within 300 s", "x\n" * 50 + "RuntimeError: " + "y" * 500)
    short = vp.peer_error(long)
    assert "\n" not in short and len(short) <= 300
    assert short.startswith("vLLM not ready within 300 s: RuntimeError: y")
    assert vp.peer_error(FileNotFoundError("no such file")) == "FileNotFoundError: no such file"
    timeout = subprocess.TimeoutExpired(["python", "x"], 5)
    assert vp.peer_error(timeout).startswith("timed out after 5 s")

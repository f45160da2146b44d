"""Native kernels the engine builds at run time: decode attention over the paged KV pool.

torch has no CPU kernel that reads attention keys through a page table: gathering every
sequence's pages into a padded tensor first costs a full extra copy of the batch's KV per
layer per step (measured here: 2x the attention time of the contiguous layout at batch 32),
which would make paging slower than the unbounded layout it replaces. So the CPU decode
path is one small C function (`paged_attention.c`), compiled with the machine's C compiler
the first time a pool of that head size and page size is used, the way torch.compile's
CPU backend builds its kernels: `cc -O3 -march=native -fopenmp` (see FLAGS). The shared
object is kept in a per-user cache keyed by the source, the flags and the CPU, so a worker's
start pays the ~0.3 s build once per machine. Without a compiler (or on another device)
`load` returns None and the engine takes the torch path (gather + SDPA), which is correct,
only slower.

The function is called through ctypes with the tensors' data pointers; torch is imported
first, so the OpenMP runtime the kernel links is the one torch already loaded (one thread
pool, not two fighting for the cores).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("mooncake.engine.native")

SOURCE = Path(__file__).with_name("paged_attention.c")
# Not -ffast-math: gcc links crtfastmath.o into a shared object built with it, which sets
# flush-to-zero / denormals-are-zero for the whole process when the kernel is loaded (every
# torch op of the worker would then flush subnormals). The kernel's loops keep independent
# accumulators, so they vectorize without reassociation; expf needs only no errno.
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-shared",
         "-fPIC")  # fmt: skip
_lock = threading.Lock()
_loaded: dict[tuple[int, int], PagedDecode | None] = {}


def cache_dir() -> Path:
    """Where built kernels are kept: ~/.cache/mooncake/kernels, or a temp dir if that is
    not writable (a read-only home in a container)."""
    home = Path.home() / ".cache" / "mooncake" / "kernels"
    try:
        home.mkdir(parents=True, exist_ok=True)
        if os.access(home, os.W_OK):
            return home
    except OSError:
        pass
    fallback = Path(tempfile.gettempdir()) / f"mooncake-kernels-{os.getuid()}"
    fallback.mkdir(parents=True, exist_ok=True)
    return fallback


def _cpu_signature() -> str:
    """What `-march=native` depends on: the CPU's model and flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines))) + platform.machine()


def _compiler() -> str | None:
    return shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _build(head_dim: int, page_tokens: int) -> Path | None:
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler: paged decode attention takes the slower torch path")
        return None
    defines = (f"-DHEAD_DIM={head_dim}", f"-DPAGE_TOKENS={page_tokens}")
    digest = hashlib.sha256(
        SOURCE.read_bytes() + " ".join((cc, *FLAGS, *defines)).encode() + _cpu_signature().encode()
    ).hexdigest()[:20]
    target = cache_dir() / f"paged_attention-d{head_dim}-p{page_tokens}-{digest}.so"
    if target.exists():
        return target
    # Build to a private name, then rename: workers starting together never see half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [cc, *FLAGS, *defines, str(SOURCE), "-o", tmp, "-lm"]
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)
        os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError) as exc:
        err = getattr(exc, "stderr", b"") or b""
        log.warning("building the paged attention kernel failed (%s %s): torch path", exc, err)
        Path(tmp).unlink(missing_ok=True)
        return None
    return target


@dataclass(frozen=True)
class PagedDecode:
    """The built kernel for one (head_dim, page_tokens)."""

    head_dim: int
    page_tokens: int
    fn: ctypes._CFuncPtr  # type: ignore[name-defined]

    def __call__(
        self,
        q: torch.Tensor,
        kpool: torch.Tensor,
        vpool: torch.Tensor,
        table: torch.Tensor,
        lens: torch.Tensor,
        out: torch.Tensor,
        scale: float,
    ) -> None:
        """q, out [B, kv_heads, group, D] float32 contiguous; kpool [pages, kv_heads, D, P],
        vpool [pages, kv_heads, P, D]; table [B, max_pages] int32; lens [B] int32."""
        b, kv_heads, group, _ = q.shape
        failed = self.fn(
            q.data_ptr(),
            kpool.data_ptr(),
            vpool.data_ptr(),
            table.data_ptr(),
            lens.data_ptr(),
            out.data_ptr(),
            b,
            kv_heads,
            group,
            table.shape[1],
            scale,
            torch.get_num_threads(),
        )
        if failed:
            raise RuntimeError("paged attention: a length outside its page table")


def load(head_dim: int, page_tokens: int) -> PagedDecode | None:
    """The kernel for this shape, built on first use (None: none can be built here)."""
    key = (head_dim, page_tokens)
    with _lock:
        if key not in _loaded:
            _loaded[key] = _load(head_dim, page_tokens)
        return _loaded[key]


def _load(head_dim: int, page_tokens: int) -> PagedDecode | None:
    path = _build(head_dim, page_tokens)
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        log.warning("loading %s failed (%s): torch path", path, exc)
        return None
    fn = lib.mc_paged_decode_f32
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    fn.argtypes = [ptr] * 6 + [i32] * 4 + [ctypes.c_float, i32]
    fn.restype = i32
    return PagedDecode(head_dim, page_tokens, fn)

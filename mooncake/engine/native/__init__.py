"""Native kernels the engine builds at run time: decode attention over the paged KV pool,
prefill attention over it (`prefill_attention.c`: a prompt's new tokens over its cached
prefix and themselves, read in place from the pages), GEMMs over block-quantized weights
(`quant_gemm.c`, see `engine.quant`), and a whole decoder layer of a decode step
(`decode_layer.c`, see `engine.fused`), and a prefill's row-wise steps between its GEMMs
(`prefill_rows.c`: RoPE and the head-major layout of q, k, v).

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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar, cast

import torch

log = logging.getLogger("mooncake.engine.native")

SOURCE = Path(__file__).with_name("paged_attention.c")
QUANT_SOURCE = Path(__file__).with_name("quant_gemm.c")
LAYER_SOURCE = Path(__file__).with_name("decode_layer.c")  # includes the two above
PREFILL_SOURCE = Path(__file__).with_name("prefill_attention.c")  # includes paged_attention.c
ROWS_SOURCE = Path(__file__).with_name("prefill_rows.c")
# Not -ffast-math: gcc links crtfastmath.o into a shared object built with it, which sets
# flush-to-zero / denormals-are-zero for the whole process when the kernel is loaded (every
# torch op of the worker would then flush subnormals). The kernel's loops keep independent
# accumulators, so they vectorize without reassociation; expf needs only no errno.
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-shared",
         "-fPIC")  # fmt: skip
_lock = threading.Lock()
T = TypeVar("T")


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


def build(
    source: Path, defines: tuple[str, ...] = (), what: str = "", deps: tuple[Path, ...] = ()
) -> Path | None:
    """The shared object of `source` built with FLAGS and `defines` (cached by the source,
    the files it includes (`deps`), the flags and the CPU; see the module docstring), or None
    where none can be built here (no compiler, a failed build)."""
    what = what or source.stem
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler: %s takes the slower torch path", what)
        return None
    text = b"".join(f.read_bytes() for f in (source, *deps))
    digest = hashlib.sha256(
        text + " ".join((cc, *FLAGS, *defines)).encode() + _cpu_signature().encode()
    ).hexdigest()[:20]
    tag = "".join(f"-{d.split('=', 1)[-1]}" for d in defines)
    target = cache_dir() / f"{source.stem}{tag}-{digest}.so"
    if target.exists():
        return target
    # Build to a private name, then rename: workers starting together never see half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [cc, *FLAGS, *defines, str(source), "-o", tmp, "-lm"]
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)
        os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError) as exc:
        err = getattr(exc, "stderr", b"") or b""
        log.warning("building %s failed (%s %s): torch path", what, exc, err)
        Path(tmp).unlink(missing_ok=True)
        return None
    return target


_built: dict[tuple[object, ...], object] = {}


def _once(key: tuple[object, ...], make: Callable[[], T]) -> T:
    """make() the first time `key` is asked for (under the lock), the same object after."""
    with _lock:
        if key not in _built:
            _built[key] = make()
        return cast(T, _built[key])


def _open(
    source: Path, defines: tuple[str, ...], what: str, deps: tuple[Path, ...] = ()
) -> ctypes.CDLL | None:
    """The built library of `source` loaded, or None (logged) where it cannot be."""
    path = build(source, defines, what, deps)
    if path is None:
        return None
    try:
        return ctypes.CDLL(str(path))
    except OSError as exc:
        log.warning("loading %s failed (%s): torch path", path, exc)
        return None


def _shape(head_dim: int, page_tokens: int, kv_bf16: bool) -> tuple[str, ...]:
    """The defines of a kernel built for one pool shape: its head size, its page size, and
    with `kv_bf16` a pool of bfloat16 (paged_attention.c's kv_t), else of float32."""
    kv = ("-DKV_BF16",) if kv_bf16 else ()
    return (f"-DHEAD_DIM={head_dim}", f"-DPAGE_TOKENS={page_tokens}", *kv)


@dataclass(frozen=True)
class ShapedKernel:
    """A kernel built for one (head_dim, page_tokens) and pool element type (`kv_bf16`:
    bfloat16, else float32): its C function."""

    head_dim: int
    page_tokens: int
    fn: ctypes._CFuncPtr  # type: ignore[name-defined]
    kv_bf16: bool

    @property
    def kv_dtype(self) -> torch.dtype:
        """The pool element type the kernel reads and writes."""
        return torch.bfloat16 if self.kv_bf16 else torch.float32

    def check_pool(self, *pools: torch.Tensor) -> None:
        """RuntimeError unless every pool tensor is of the kernel's element type on the CPU
        (the C code reads their bytes as that type)."""
        for t in pools:
            if t.dtype != self.kv_dtype or t.device.type != "cpu":
                raise RuntimeError(f"a {t.dtype} pool on {t.device} for a {self.kv_dtype} kernel")


class PagedDecode(ShapedKernel):
    """paged_attention.c's decode attention."""

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
        vpool [pages, kv_heads, P, D] of the kernel's pool type; table [B, max_pages] int32;
        lens [B] int32."""
        b, kv_heads, group, _ = q.shape
        self.check_pool(kpool, vpool)
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
        if failed == 1:
            raise RuntimeError("paged attention: a length outside its page table")
        if failed:
            raise MemoryError("paged attention: no memory for the split sequences' partial sums")


class BlockWriter(ShapedKernel):
    """paged_attention.c's copy of whole store blocks into pool pages (KVPool.write_blocks)."""

    def __call__(self, blocks: torch.Tensor, pages: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> None:  # fmt: skip
        """blocks [layers, n, 2, kv_heads, T, D] of the pool's type, each block contiguous
        (any strides between blocks and layers); pages int32 [n * T / P], contiguous, the same for
        every layer; k [layers, pages, kv_heads, D, P], v [layers, pages, kv_heads, P, D], views
        into one pool tensor with the same stride between layers."""
        layers, n, _, kv_heads, tokens, dim = blocks.shape
        self.check_pool(blocks, k, v)
        # The C copy trusts its arguments: the caller (KVPool) has checked the pages are the
        # pool's and as many as the blocks cover; shapes that do not fit are refused here.
        if (dim, kv_heads, tokens % self.page_tokens) != (self.head_dim, k.shape[2], 0) or (
            layers != k.shape[0] or k.stride(0) != v.stride(0)
        ):
            raise RuntimeError(f"block writer: blocks {tuple(blocks.shape)} do not fit the pool")
        if self.fn(blocks.data_ptr(), blocks.stride(0), blocks.stride(1), layers, n, tokens,
                   pages.data_ptr(), k.data_ptr(), v.data_ptr(), k.stride(0), kv_heads,
                   torch.get_num_threads()):  # fmt: skip
            raise RuntimeError("block writer: a block is not a whole number of pages")


def load_block_writer(head_dim: int, page_tokens: int, kv_bf16: bool = False) -> BlockWriter | None:
    """The block writer for this shape, built on first use (None: none can be built here)."""
    return _once(
        ("block writer", head_dim, page_tokens, kv_bf16),
        lambda: _load_writer(head_dim, page_tokens, kv_bf16),
    )


def _load_writer(head_dim: int, page_tokens: int, kv_bf16: bool) -> BlockWriter | None:
    defines = _shape(head_dim, page_tokens, kv_bf16)
    lib = _open(SOURCE, defines, "paged decode attention")  # the decode kernel's library
    if lib is None:
        return None
    fn = lib.mc_write_blocks_f32
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    lng = ctypes.c_long
    fn.argtypes = [ptr, lng, lng, i32, i32, i32, ptr, ptr, ptr, lng, i32, i32]
    fn.restype = i32
    return BlockWriter(head_dim, page_tokens, fn, kv_bf16)


def load(head_dim: int, page_tokens: int, kv_bf16: bool = False) -> PagedDecode | None:
    """The kernel for this shape, built on first use (None: none can be built here)."""
    return _once(
        ("attention", head_dim, page_tokens, kv_bf16), lambda: _load(head_dim, page_tokens, kv_bf16)
    )


def _load(head_dim: int, page_tokens: int, kv_bf16: bool) -> PagedDecode | None:
    defines = _shape(head_dim, page_tokens, kv_bf16)
    lib = _open(SOURCE, defines, "paged decode attention")
    if lib is None:
        return None
    fn = lib.mc_paged_decode_f32
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    fn.argtypes = [ptr] * 6 + [i32] * 4 + [ctypes.c_float, i32]
    fn.restype = i32
    return PagedDecode(head_dim, page_tokens, fn, kv_bf16)


@dataclass(frozen=True)
class PagedPrefill(ShapedKernel):
    """prefill_attention.c's prefill attention. `bf16`: this build multiplies in bfloat16
    (asked for, and the CPU has AVX512_BF16 dot products): queries, keys, values and
    softmax weights rounded to bfloat16, every sum in float32."""

    bf16: bool = False

    def __call__(
        self,
        q: torch.Tensor,
        kpool: torch.Tensor,
        vpool: torch.Tensor,
        pages: torch.Tensor,
        start: int,
        scale: float,
    ) -> torch.Tensor:
        """Attention of S new tokens at positions start..start+S-1, each over every key up
        to its own: q [S, heads, D] float32 (any strides but D's, which must be 1); kpool
        [pages, kv_heads, D, P], vpool [pages, kv_heads, P, D] of the kernel's pool type;
        pages int32, the sequence's
        pool pages covering its start + S positions (their K, V written). Returns [S, heads,
        D]."""
        s, heads, dim = q.shape
        kv_heads = kpool.shape[1]
        self.check_pool(kpool, vpool)
        if q.stride(2) != 1:
            q = q.contiguous()
        if pages.numel() * self.page_tokens < start + s:
            raise RuntimeError("paged prefill: the page table does not cover the positions")
        out = torch.empty((s, heads, dim), dtype=q.dtype, device=q.device)
        if self.fn(q.data_ptr(), q.stride(0), q.stride(1), kpool.data_ptr(), vpool.data_ptr(),
                   pages.data_ptr(), out.data_ptr(), s, start, kv_heads, heads // kv_heads,
                   scale, torch.get_num_threads()):  # fmt: skip
            raise RuntimeError("paged prefill: a shape this build does not support")
        return out


def load_prefill(
    head_dim: int,
    page_tokens: int,
    *,
    bf16: bool = False,
    avx2: bool = False,
    kv_bf16: bool = False,
) -> PagedPrefill | None:
    """The prefill kernel for this shape, built on first use (None: none can be built here,
    or the shape is not one it supports: head_dim and page_tokens multiples of 16, and
    page_tokens dividing 64). `bf16`: multiplying in bfloat16 where the CPU has AVX512_BF16
    (elsewhere the float32 build). `avx2`: built without AVX-512, as on a machine without it
    (its 8-float vectors and register tiles), so a test on an AVX-512 machine covers both.
    `kv_bf16`: over a pool of bfloat16, else of float32."""
    return _once(
        ("prefill", head_dim, page_tokens, bf16, avx2, kv_bf16),
        lambda: _load_prefill(head_dim, page_tokens, bf16, avx2, kv_bf16),
    )


def _load_prefill(
    head_dim: int, page_tokens: int, bf16: bool, avx2: bool, kv_bf16: bool
) -> PagedPrefill | None:
    defines = _shape(head_dim, page_tokens, kv_bf16)
    if bf16:
        defines += ("-DPREFILL_BF16",)
    if avx2:
        defines += ("-mno-avx512f",)
    lib = _open(PREFILL_SOURCE, defines, "paged prefill attention", deps=(SOURCE,))
    if lib is None or not lib.mc_paged_prefill_supported():
        return None
    fn = lib.mc_paged_prefill_f32
    ptr, i32, long = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    fn.argtypes = [ptr, long, long, ptr, ptr, ptr, ptr, i32, i32, i32, i32, ctypes.c_float, i32]
    fn.restype = i32
    return PagedPrefill(head_dim, page_tokens, fn, kv_bf16, bool(lib.mc_paged_prefill_bf16()))


@dataclass(frozen=True)
class QuantKernels:
    """quant_gemm.c's functions: `q4_gemm`/`q8_gemm` (qs, scales, x, y, M, N, K, threads),
    `q4_dequant`/`q8_dequant` (qs, scales, out, n0, n1, K, threads) into float32 and
    `q4_dequant_bf16`/`q8_dequant_bf16` (the same) into bfloat16; each returns non-zero for
    a K that is not a whole number of blocks."""

    q4_gemm: ctypes._CFuncPtr  # type: ignore[name-defined]
    q8_gemm: ctypes._CFuncPtr  # type: ignore[name-defined]
    q4_dequant: ctypes._CFuncPtr  # type: ignore[name-defined]
    q8_dequant: ctypes._CFuncPtr  # type: ignore[name-defined]
    q4_dequant_bf16: ctypes._CFuncPtr  # type: ignore[name-defined]
    q8_dequant_bf16: ctypes._CFuncPtr  # type: ignore[name-defined]


def load_quant() -> QuantKernels | None:
    """The quantized-weight kernels, built on first use (None: none can be built here)."""
    return _once(("quant",), _load_quant)


def _load_quant() -> QuantKernels | None:
    lib = _open(QUANT_SOURCE, (), "quantized-weight GEMM")
    if lib is None:
        return None
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    fns = []
    for name, args in (("mc_q4_gemm", [ptr] * 4 + [i32] * 4), ("mc_q8_gemm", [ptr] * 4 + [i32] * 4),
                       ("mc_q4_dequant", [ptr] * 3 + [i32] * 4),
                       ("mc_q8_dequant", [ptr] * 3 + [i32] * 4),
                       ("mc_q4_dequant_bf16", [ptr] * 3 + [i32] * 4),
                       ("mc_q8_dequant_bf16", [ptr] * 3 + [i32] * 4)):  # fmt: skip
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, i32
        fns.append(fn)
    return QuantKernels(*fns)


class MCQWeight(ctypes.Structure):
    """decode_layer.c's mc_qweight."""

    _fields_ = [("kind", ctypes.c_int32), ("n", ctypes.c_int32), ("k", ctypes.c_int32),
                ("qs", ctypes.c_void_p), ("scales", ctypes.c_void_p)]  # fmt: skip


class MCLayerArgs(ctypes.Structure):
    """decode_layer.c's mc_layer_args."""

    _fields_ = [
        ("x", ctypes.c_void_p), ("attn_norm", ctypes.c_void_p), ("ffn_norm", ctypes.c_void_p),
        ("w", MCQWeight * 4), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
        ("kpool", ctypes.c_void_p), ("vpool", ctypes.c_void_p), ("page", ctypes.c_void_p),
        ("offset", ctypes.c_void_p), ("table", ctypes.c_void_p), ("lens", ctypes.c_void_p),
        ("scratch", ctypes.c_void_p),
        ("M", ctypes.c_int32), ("hidden", ctypes.c_int32), ("heads", ctypes.c_int32),
        ("kv_heads", ctypes.c_int32), ("ffn", ctypes.c_int32), ("rot", ctypes.c_int32),
        ("max_pages", ctypes.c_int32), ("threads", ctypes.c_int32),
        ("eps", ctypes.c_float), ("scale", ctypes.c_float),
    ]  # fmt: skip


@dataclass(frozen=True)
class DecodeLayer:
    """decode_layer.c built for one (head_dim, page_tokens): `layers(args, count)` runs a
    decode step through `count` layers (an array of MCLayerArgs; 0, or non-zero for
    arguments it refuses), `scratch_floats(M, hidden, heads, kv_heads, ffn)` sizes the
    scratch buffer they share."""

    layers: ctypes._CFuncPtr  # type: ignore[name-defined]
    scratch_floats: ctypes._CFuncPtr  # type: ignore[name-defined]


def load_decode_layer(head_dim: int, page_tokens: int, kv_bf16: bool = False) -> DecodeLayer | None:
    """The fused decode layer for this shape and pool type, built on first use (None: none
    here)."""
    return _once(
        ("layer", head_dim, page_tokens, kv_bf16),
        lambda: _load_decode_layer(head_dim, page_tokens, kv_bf16),
    )


def _load_decode_layer(head_dim: int, page_tokens: int, kv_bf16: bool) -> DecodeLayer | None:
    defines = _shape(head_dim, page_tokens, kv_bf16)
    lib = _open(LAYER_SOURCE, defines, "fused decode layer", deps=(SOURCE, QUANT_SOURCE))
    if lib is None:
        return None
    layers, scratch = lib.mc_decode_layers, lib.mc_decode_scratch_floats
    layers.argtypes, layers.restype = [ctypes.POINTER(MCLayerArgs), ctypes.c_int], ctypes.c_int
    scratch.argtypes, scratch.restype = [ctypes.c_int] * 5, ctypes.c_long
    return DecodeLayer(layers, scratch)


@dataclass(frozen=True)
class RowKernels:
    """prefill_rows.c's function (see there): `rope_qkv`."""

    rope: ctypes._CFuncPtr  # type: ignore[name-defined]

    def rope_qkv(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_row0: int,
        q_from: int,
        q_row0: int,
    ) -> None:
        """Rows of one sequence's fused q/k/v GEMM result `qkv` [rows, (heads + 2 kv_heads)
        * D] (bfloat16 or float32, rows contiguous), cos, sin [rows, R] float32 contiguous,
        into q [heads, q_len, D] (rows q_from.. at q_row0..) and k, v [kv_heads, kv_len, D]
        (at kv_row0..), all three contiguous, of one dtype (bfloat16 or float32), on the CPU.
        qkv's rows and the tables are made contiguous if they are not; anything else that
        does not fit is refused (RuntimeError) before the C function runs."""
        qkv = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        rows, width = qkv.shape
        heads, q_len, dim = q.shape
        kv_heads, kv_len, _ = k.shape
        ok = (
            width == (heads + 2 * kv_heads) * dim
            and k.shape == v.shape == (kv_heads, kv_len, dim)
            and q.dtype == k.dtype == v.dtype
            and {qkv.dtype, q.dtype} <= {torch.float32, torch.bfloat16}
            and cos.dtype == sin.dtype == torch.float32
            and all(t.device.type == "cpu" for t in (qkv, cos, sin, q, k, v))
            and all(t.is_contiguous() for t in (q, k, v))
            and cos.shape == sin.shape == (rows, cos.shape[-1])
            and min(kv_row0, q_from, q_row0) >= 0
            and kv_row0 + rows <= kv_len
            and q_row0 + max(0, rows - q_from) <= q_len
        )
        if not ok or self.rope(
            qkv.data_ptr(), int(qkv.dtype == torch.bfloat16), qkv.stride(0), rows, heads,
            kv_heads, dim, cos.shape[-1], cos.data_ptr(), sin.data_ptr(), q.data_ptr(),
            k.data_ptr(), v.data_ptr(), int(q.dtype == torch.bfloat16), q_len, kv_len,
            kv_row0, q_from, q_row0, torch.get_num_threads(),
        ):  # fmt: skip
            raise RuntimeError(f"rope_qkv: shapes it does not take ({tuple(qkv.shape)})")


def load_rows() -> RowKernels | None:
    """The prefill row kernels, built on first use (None: none can be built here)."""
    return _once(("rows",), _load_rows)


def _load_rows() -> RowKernels | None:
    # No fused multiply-add (torch's rounding, bit for bit): the source's pragma for gcc, the
    # flag for any compiler.
    lib = _open(ROWS_SOURCE, ("-ffp-contract=off",), "prefill row kernels")
    if lib is None:
        return None
    ptr, i32, lng = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    rope = lib.mc_rope_qkv
    rope.argtypes = [ptr, i32, lng, lng, i32, i32, i32, i32, ptr, ptr, ptr, ptr, ptr, i32,
                     lng, lng, lng, lng, lng, i32]  # fmt: skip
    rope.restype = i32
    return RowKernels(rope)

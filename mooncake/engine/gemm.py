"""Float32 GEMMs on the CPU: which kernel a product of few or many rows takes, and the
oneDNN-packed copies of weights that make the many-row ones fast (measurements in the
docstrings; BENCHMARKS.md, "bench engine"). Weights kept in quantized blocks are engine.quant's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mooncake.engine.speed import FASTER, speedup

SMALL_ROWS = 16  # at most this many rows (decode batches): decode-specific fast paths
PACK_MIN_ROWS = 3  # from this many rows: oneDNN over a packed weight (CPU, float32)
# What a weight that lives only as its packed copy is left as (an empty float32 tensor).
PACKED_ONLY = torch.empty(0)
ONEDNN = bool(torch._C._has_mkldnn) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedWeight:
    """A oneDNN-packed (blocked layout) copy of a weight, for the CPU float32 GEMMs of
    PACK_MIN_ROWS or more rows. Measured here over the model's shapes: MKL's GEMM with the
    weight first (the few-row path below) streams the weight at ~25 GB/s for up to 4
    columns but ~14 GB/s for 6 or more, and oneDNN over the packed weight at ~20 GB/s for
    3 to 16 rows, so a batch-8 decode step's GEMMs take ~1.8x less time (a single row
    stays with MKL's two-column GEMM, faster still); prefill's GEMMs (`F.linear`, MKL)
    are ~20 % faster too. Same float32 math; the sums are ordered differently, so results
    differ from MKL's in the last bits only. Built on first use and rebuilt when `weight`
    is another tensor or one of the `watched` modules' weights (the parameters `weight` is
    made of) was updated in place; it costs a second copy of the weight in memory, unless
    the weights are packed for good (`Decoder.pack_weights`, what a serving engine does)."""

    def __init__(self, *watched: nn.Linear | nn.Embedding) -> None:
        self.watched = watched
        self.source: Tensor | None = None
        self.versions: tuple[int, ...] = ()
        self.packed: Tensor | None = None
        self.frozen = False  # the packed copy is the only one (`Decoder.pack_weights`)

    def freeze(self, weight: Tensor) -> None:
        """Pack `weight` now and serve every GEMM from the packed copy from here on (its
        plain source may then be freed); the copy no longer follows weight updates."""
        self.frozen = False
        self(weight)
        self.source, self.versions, self.frozen = None, (), True

    def __getstate__(self) -> dict[str, object]:
        # Copies and pickles of a model leave the packed copy behind (rebuilt on use).
        return {**self.__dict__, "source": None, "versions": (), "packed": None}

    def __call__(self, weight: Tensor) -> Tensor:
        if self.frozen:
            assert self.packed is not None
            return self.packed
        versions = tuple(m.weight._version for m in self.watched)
        if self.packed is None or self.source is not weight or versions != self.versions:
            self.packed = None  # free the old copy before building the new one
            with torch.inference_mode(False), torch.no_grad():
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), SMALL_ROWS)
            self.source, self.versions = weight, versions
        return self.packed


def onednn_usable(x: Tensor, weight: Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,)
                  ) -> bool:  # fmt: skip
    """Whether oneDNN's CPU GEMM (`_linear_pointwise`, packed or plain weight) can take
    x @ weight.T, both of one of `dtypes`: it has no autograd, so not where gradients are
    wanted."""
    return (
        ONEDNN
        and x.device.type == "cpu"
        and x.dtype == weight.dtype
        and x.dtype in dtypes
        and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))
    )


def bf16_gemms_fast() -> bool:
    """Whether prefill GEMMs multiply faster in bfloat16 than in float32 on this CPU: it has
    bfloat16 instructions that oneDNN uses (AMX tiles, Sapphire Rapids and later Xeons, or
    AVX512_BF16 dot products, also Zen 4 and 5) and, measured, oneDNN's bfloat16 GEMM runs
    at least speed.FASTER times float32's (bf16_gemm_speedup): instructions alone are not
    enough. On a 2-vCPU Xeon with AMX (docs/history/benchmarks.md, 2026-11-28), SmolLM2's
    shapes ran at 1.0-2.3 TFLOP/s in bfloat16 against 0.24-0.29 in float32; on one whose VM
    hides AMX but has AVX512_BF16, at 0.11-0.15 against 0.20-0.26."""
    speed = bf16_gemm_speedup()
    return speed is not None and speed >= FASTER


@functools.cache
def bf16_instructions() -> bool:
    """Whether this CPU has bfloat16 instructions oneDNN's GEMMs use (see bf16_gemms_fast)."""
    cpu = getattr(torch, "cpu", None)
    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return ONEDNN and any(bool(getattr(cpu, c, lambda: False)()) for c in checks)


@functools.cache
def bf16_gemm_speedup() -> float | None:
    """How many times faster oneDNN multiplies a prefill-sized GEMM (256 rows of 1,024 by
    1,536 x 1,024) in bfloat16 than in float32 here, at torch's thread count when first
    asked (speed.speedup: the best of 9 calls each, ~0.2 s once a process); None where the
    CPU has no bfloat16 instructions oneDNN uses."""
    if not bf16_instructions():
        return None
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(256, 1024, generator=g), torch.randn(1536, 1024, generator=g)
    xb, wb = x.bfloat16(), w.bfloat16()

    def product(a: Tensor, b: Tensor) -> Callable[[], object]:
        return lambda: torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], "")

    with torch.inference_mode():
        return speedup(product(xb, wb), product(x, w))


def linear(x: Tensor, weight: Tensor, packed: PackedWeight | None = None) -> Tensor:
    """x @ weight.T. On the CPU, PACK_MIN_ROWS or more rows by oneDNN over `packed` (see
    PackedWeight) where given. Otherwise a few rows (a decode step) as (weight @ x.T).T,
    MKL's weight-major GEMM (`F.linear` with 8 rows costs ~1.3x that over a whole model),
    one row as two (below); more rows by `dense`."""
    rows = x.numel() // x.shape[-1]
    if x.device.type != "cpu":
        return F.linear(x, weight)
    x2 = x.reshape(rows, x.shape[-1])
    out: Tensor
    if packed is not None and packed.frozen:  # the only copy: any rows (as fast for 1-2)
        out = torch.ops.mkldnn._linear_pointwise(x2.contiguous(), packed(weight), None,
                                                 "none", [], "")  # fmt: skip
        return out.view(*x.shape[:-1], out.shape[-1])
    if packed is not None and rows >= PACK_MIN_ROWS and onednn_usable(x, weight):
        out = torch.ops.mkldnn._linear_pointwise(
            x2.contiguous(), packed(weight), None, "none", [], ""
        )
    elif rows > SMALL_ROWS:
        return dense(x2, weight).view(*x.shape[:-1], weight.shape[0])
    elif rows == 1:
        # One row would take MKL's gemv, which streams the weight on one thread: a second
        # (repeated) row makes it a two-thread gemm, about 2.5x faster here.
        out = torch.mm(weight, torch.cat((x2, x2)).t())[:, :1].t().contiguous()
    else:
        out = torch.mm(weight, x2.t()).t().contiguous()
    return out.view(*x.shape[:-1], weight.shape[0])


def dense(x2: Tensor, weight: Tensor) -> Tensor:
    """x2 [rows, K] @ weight.T for a weight in plain layout (not packed: one just
    dequantized, engine.quant): by oneDNN on the CPU in float32 or bfloat16 (both of one
    dtype; the result in it), else F.linear. Measured on
    this repo's AMD EPYC (Zen 5, AVX-512), SmolLM2's four projections at 256 and 1,024 rows,
    2 threads: MKL's GEMM (what F.linear runs) 170-210 GFLOP/s, oneDNN over the same plain
    weight 360-470 (MKL takes its AVX2 kernels on AMD, oneDNN its AVX-512 ones); on a Zen 3
    EPYC (AVX2 only) the two run equally fast. Same float32 math, the sums in another order."""
    # bfloat16 by oneDNN only where the CPU has its instructions (F.linear elsewhere).
    dtypes = (torch.float32, torch.bfloat16) if bf16_instructions() else (torch.float32,)
    if onednn_usable(x2, weight, dtypes):
        out: Tensor = torch.ops.mkldnn._linear_pointwise(
            x2.contiguous(), weight.contiguous(), None, "none", [], ""
        )
        return out
    return F.linear(x2, weight)


def nbytes(t: Tensor) -> int:
    try:
        return int(t.untyped_storage().nbytes())
    except (RuntimeError, NotImplementedError):  # an opaque oneDNN tensor
        return t.numel() * t.element_size()

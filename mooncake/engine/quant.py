"""Weights kept in the blocks a GGUF file quantizes them in, multiplied in float32.

A decode step on the CPU is bound by reading the weights: SmolLM2-135M's GEMM weights are
~540 MB in float32 and ~80 MB as the file's Q4_1 blocks (4 bits a value, a scale and a
minimum per 32 values). `QuantWeight` holds a weight matrix in those blocks and multiplies
float32 activations by it (`native/quant_gemm.c`: each block is widened to float32 in
registers, so the result equals a float32 GEMM over the dequantized matrix up to the order
of the sums; the activations are never quantized). The values are the file's exactly, so
nothing about the model changes but the speed and the memory.

Formats (K is a multiple of 32; block b of row n covers columns 32b .. 32b+31):
- "q4": `qs` uint8 [N, K/2], `scales` float32 [N, K/32, 2] = (d, m): w = d * q + m with q in
  0..15; byte j of a block holds element j in its low nibble, element j + 16 in its high one.
  GGUF's Q4_1 as it is; Q4_0 (w = d * (q - 8)) as m = -8 d.
- "q8": `qs` int8 [N, K], `scales` float32 [N, K/32]: w = d * q. GGUF's Q8_0.

Other GGUF types (K-quants, Q5) are dequantized to float32 by the loader as before.

Few rows (a decode batch, <= DIRECT_ROWS) go through the native kernel, which reads each
block once for up to 8 rows. More rows (a prefill) are compute-bound: the matrix is
dequantized a slice of at most SLICE_FLOATS values at a time into float32 and multiplied by
oneDNN's GEMM (`gemm.dense`). Without a C compiler every product takes that second path.

The slices go into one buffer a process keeps (`Scratch`, 8 MiB), not a new tensor each:
a new one was memory the OS mapped page by page after each prefill gave its heap back,
written out to DRAM and read back by the GEMM; the kept one stays in the caches. Measured
on a 2-vCPU Zen 5 EPYC, the two ways alternating in one process (docs/history/benchmarks.md,
2026-11-28): a 256-token prefill after 1,792 cached tokens ran 4 % faster (289 -> 272 ms,
medians of 8), a cold 2,048-token one as fast.

In bfloat16 (`bf16`, Decoder.use_bf16_gemms, `EngineSettings.gemm`), the slices are
dequantized to bfloat16 (the file's values rounded to the nearest even) into the same
buffer, the activations rounded to bfloat16, and oneDNN's bfloat16 GEMM sums the products
in float32 and rounds the result to bfloat16 (returned as float32, or as bfloat16 where the
caller keeps its activations in it: `out_bf16`, Block's prefill). Where the CPU has AMX
tiles this is ~4-8x the float32 GEMM's speed (a 2-vCPU Xeon, SmolLM2's shapes: 1.0-2.3
against 0.24-0.29 TFLOP/s), but ~0.65x where it has AVX512_BF16 alone (a Xeon whose VM
hides AMX), so the engine takes it only where it measures faster (gemm.bf16_gemms_fast);
the price is bfloat16's rounding, as in a bfloat16 model.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from mooncake.engine import native
from mooncake.engine.errors import EngineError
from mooncake.engine.gemm import dense

QK = 32  # values per block
Q4_BLOCK_BYTES = 2 + 2 + QK // 2  # GGUF Q4_1: fp16 d, fp16 m, 16 bytes of nibbles
Q40_BLOCK_BYTES = 2 + QK // 2  # GGUF Q4_0: fp16 d, 16 bytes of nibbles
Q8_BLOCK_BYTES = 2 + QK  # GGUF Q8_0: fp16 d, 32 int8
DIRECT_ROWS = 16  # at most this many rows: the native block kernel
SLICE_FLOATS = 1 << 21  # a prefill dequantizes at most this many values at a time (8 MiB)
GGUF_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # what stays quantized

Kind = Literal["q4", "q8"]


@dataclass
class QuantWeight:
    kind: Kind
    qs: Tensor
    scales: Tensor
    out_features: int
    in_features: int

    def __post_init__(self) -> None:
        n, k = self.out_features, self.in_features
        if k % QK:
            raise EngineError(f"a quantized weight needs {QK}-value blocks, not {k} columns")
        want_qs = (n, k // 2) if self.kind == "q4" else (n, k)
        want_sc = (n, k // QK, 2) if self.kind == "q4" else (n, k // QK)
        if tuple(self.qs.shape) != want_qs or tuple(self.scales.shape) != want_sc:
            raise EngineError(
                f"{self.kind} weight of {n}x{k}: blocks {tuple(self.qs.shape)} and scales "
                f"{tuple(self.scales.shape)}, expected {want_qs} and {want_sc}"
            )
        self.qs, self.scales = self.qs.contiguous(), self.scales.float().contiguous()
        # A decode step makes ~120 of these calls: what they need is looked up once.
        self._fast: tuple[Any, int, int] | None = None

    def _direct(self) -> tuple[Any, int, int] | None:
        """The native GEMM and the blocks' addresses, or None where there is no kernel."""
        if self._fast is None and self.qs.device.type == "cpu":
            kernels = native.load_quant()
            if kernels is not None:
                gemm = kernels.q4_gemm if self.kind == "q4" else kernels.q8_gemm
                self._fast = (gemm, self.qs.data_ptr(), self.scales.data_ptr())
        return self._fast

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_fast": None}  # addresses do not survive a copy

    @property
    def nbytes(self) -> int:
        return self.qs.numel() * self.qs.element_size() + self.scales.numel() * 4

    def __call__(self, x: Tensor, bf16: bool = False, out_bf16: bool = False) -> Tensor:
        """x [..., K] float32 (or bfloat16) -> x @ W.T [..., N] float32. `bf16`: a GEMM of
        more than DIRECT_ROWS rows multiplies in bfloat16 (see the top), and with `out_bf16`
        returns its bfloat16 result as it is (no float32 copy: the same values)."""
        if x.shape[-1] != self.in_features:
            raise EngineError(f"{x.shape[-1]} inputs for a weight of {self.in_features}")
        rows = x.numel() // self.in_features
        direct = self._direct() if rows <= DIRECT_ROWS and x.device.type == "cpu" else None
        if direct is None:
            x2 = x.reshape(rows, self.in_features)
            if not (bf16 and x2.dtype == torch.bfloat16):
                x2 = x2.float()
            out2 = self._sliced(x2, bf16, out_bf16 and bf16)
            return out2.view(*x.shape[:-1], self.out_features)
        gemm, qs, scales = direct
        x2 = x.float().contiguous()
        out = x2.new_empty(*x.shape[:-1], self.out_features)
        _check(gemm(qs, scales, x2.data_ptr(), out.data_ptr(), rows, self.out_features,
                    self.in_features, torch.get_num_threads()))  # fmt: skip
        return out

    def _sliced(self, x2: Tensor, bf16: bool = False, out_bf16: bool = False) -> Tensor:
        n, k = self.out_features, self.in_features
        dtype = torch.bfloat16 if bf16 else torch.float32
        step = min(n, max(1, SLICE_FLOATS // k))
        xin = x2.to(dtype)
        with SCRATCH.take(step * k if self.qs.device.type == "cpu" else 0) as buf:
            if buf is not None and bf16:
                buf = buf.view(dtype)
            if step == n:
                whole = dense(xin, self.dequantize(out=buf, dtype=dtype))
                return whole if out_bf16 else whole.float()
            out = x2.new_empty(x2.shape[0], n, dtype=dtype if out_bf16 else torch.float32)
            for a in range(0, n, step):
                b = min(a + step, n)
                out[:, a:b] = dense(xin, self.dequantize(a, b, out=buf, dtype=dtype))
            return out

    def dequantize(
        self,
        start: int = 0,
        stop: int | None = None,
        out: Tensor | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> Tensor:
        """Rows start..stop-1 of the matrix as `dtype` (float32, or bfloat16 rounded to the
        nearest even) [rows, K]: a new tensor, or the first (stop - start) x K values of
        `out` (contiguous, of `dtype`, on the CPU, large enough)."""
        if dtype not in (torch.float32, torch.bfloat16):
            raise EngineError(f"quantized weights dequantize to float32 or bfloat16, not {dtype}")
        stop = self.out_features if stop is None else stop
        kernels = native.load_quant() if self.qs.device.type == "cpu" else None
        if kernels is None:
            ids = torch.arange(start, stop, device=self.qs.device)
            return self._dequantize_torch(ids).to(dtype)
        rows = stop - start
        if out is None:
            out = torch.empty(rows, self.in_features, dtype=dtype)
        elif out.dtype != dtype or not out.is_contiguous() or out.numel() < rows * self.in_features:
            raise EngineError(
                f"a dequantization buffer must be {dtype}, contiguous and large enough"
            )
        else:
            out = out[: rows * self.in_features].view(rows, self.in_features)
        if dtype == torch.bfloat16:
            fn = kernels.q4_dequant_bf16 if self.kind == "q4" else kernels.q8_dequant_bf16
        else:
            fn = kernels.q4_dequant if self.kind == "q4" else kernels.q8_dequant
        _check(fn(self.qs.data_ptr(), self.scales.data_ptr(), out.data_ptr(), start, stop,
                  self.in_features, torch.get_num_threads()))  # fmt: skip
        return out

    def rows(self, ids: Tensor) -> Tensor:
        """The rows `ids` (any shape) as float32 [*ids.shape, K]: an embedding lookup."""
        flat = self._dequantize_torch(ids.reshape(-1))
        return flat.view(*ids.shape, self.in_features)

    def _dequantize_torch(self, ids: Tensor) -> Tensor:
        n, nb = ids.numel(), self.in_features // QK
        if self.kind == "q4":
            qs = self.qs[ids].view(n, nb, QK // 2)
            q = torch.cat((qs & 15, qs >> 4), dim=-1).float()
            sc = self.scales[ids]
            w = q * sc[..., :1] + sc[..., 1:]
        else:
            w = self.qs[ids].view(n, nb, QK).float() * self.scales[ids][..., None]
        return w.reshape(n, self.in_features)

    @staticmethod
    def cat(parts: Sequence[QuantWeight]) -> QuantWeight:
        """The weights stacked by rows (one GEMM for q, k and v): all of one kind."""
        kinds = {p.kind for p in parts}
        if len(kinds) != 1 or len({p.in_features for p in parts}) != 1:
            raise EngineError("only weights of one kind and width can be fused")
        return QuantWeight(
            parts[0].kind,
            torch.cat([p.qs for p in parts]),
            torch.cat([p.scales for p in parts]),
            sum(p.out_features for p in parts),
            parts[0].in_features,
        )


class Scratch:
    """The float32 buffer a process's prefill GEMMs dequantize their weight slices into
    (see the top): one, made at the first use, pre-touched and kept, SLICE_FLOATS values
    (8 MiB, part of the memory a worker allows beyond its weights and KV). One GEMM uses it
    at a time; a GEMM running meanwhile on another thread dequantizes into a new tensor."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buf: Tensor | None = None

    @contextmanager
    def take(self, floats: int) -> Iterator[Tensor | None]:
        """The buffer (at least `floats` values) while the block runs, or None if another
        thread holds it or `floats` is 0."""
        if floats <= 0 or not self._lock.acquire(blocking=False):
            yield None
            return
        try:
            if self._buf is None or self._buf.numel() < floats:
                self._buf = torch.zeros(max(floats, SLICE_FLOATS))
            yield self._buf
        finally:
            self._lock.release()


SCRATCH = Scratch()


def _check(failed: int) -> None:
    if failed:
        raise EngineError("quantized GEMM: columns not a whole number of blocks")


def from_gguf_blocks(type_name: str, raw: Any, shape: tuple[int, int]) -> QuantWeight:
    """A weight of `shape` (rows, columns) from a GGUF tensor's raw blocks (uint8, one row of
    blocks per matrix row) of type Q4_0, Q4_1 or Q8_0."""
    n, k = shape
    data = np.ascontiguousarray(np.asarray(raw, dtype=np.uint8)).reshape(n, -1)
    nb = k // QK
    if type_name == "Q8_0":
        blocks = data.reshape(n, nb, Q8_BLOCK_BYTES)
        d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        q = blocks[..., 2:].copy().view(np.int8).reshape(n, k)
        return QuantWeight("q8", torch.from_numpy(q), torch.from_numpy(d), n, k)
    if type_name == "Q4_1":
        blocks = data.reshape(n, nb, Q4_BLOCK_BYTES)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blocks[..., 4:]
    elif type_name == "Q4_0":
        blocks = data.reshape(n, nb, Q40_BLOCK_BYTES)
        d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        m = -8.0 * d
        qs = blocks[..., 2:]
    else:
        raise EngineError(f"GGUF type {type_name} is not kept quantized")
    scales = np.stack((d, m), axis=-1)
    qs = np.ascontiguousarray(qs).reshape(n, k // 2)
    return QuantWeight("q4", torch.from_numpy(qs.copy()), torch.from_numpy(scales), n, k)


def permute_rows(w: QuantWeight, order: np.ndarray) -> QuantWeight:
    """The same weight with its rows in `order` (undoing GGUF's q/k row interleaving)."""
    idx = torch.from_numpy(np.asarray(order, dtype=np.int64))
    return QuantWeight(w.kind, w.qs[idx], w.scales[idx], w.out_features, w.in_features)

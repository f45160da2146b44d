"""KV of one sequence, and the byte layout of one KV block.

A block holds the KV of `block_tokens` consecutive tokens for every layer. Its bytes are

    header (32 bytes, little-endian, struct "<4sHBBIIII8x"):
        magic b"MCKV", version (1), dtype code (0 float32, 1 float16, 2 bfloat16), 0,
        layers, kv_heads, block_tokens, head_dim, 8 zero bytes
    payload: a C-contiguous array [layers, 2, kv_heads, block_tokens, head_dim]
        (layer-major; within a layer K then V), elements little-endian in that dtype.

K is stored after RoPE (as attention reads it), so a block is only valid at the positions it
was computed for: blocks are keyed by chained hashes (mooncake.hashing), which pin the prefix.
"""

from __future__ import annotations

import struct
import sys

import torch
from torch import Tensor

from mooncake.engine.errors import EngineError
from mooncake.engine.spec import ModelSpec

MAGIC = b"MCKV"
VERSION = 1
HEADER = struct.Struct("<4sHBBIIII8x")
DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


def block_to_bytes(block: Tensor) -> bytes:
    """Serialize one block tensor [layers, 2, kv_heads, block_tokens, head_dim]."""
    if block.dim() != 5 or block.shape[1] != 2 or block.dtype not in DTYPE_CODES:
        raise EngineError(f"not a KV block: shape {tuple(block.shape)} dtype {block.dtype}")
    if sys.byteorder != "little":  # pragma: no cover - every supported platform is
        raise EngineError("KV block bytes are little-endian; big-endian hosts are unsupported")
    layers, _, heads, tokens, dim = block.shape
    head = HEADER.pack(MAGIC, VERSION, DTYPE_CODES[block.dtype], 0, layers, heads, tokens, dim)
    payload = block.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
    return head + payload


def block_from_bytes(data: bytes, device: torch.device | str = "cpu") -> Tensor:
    """The inverse of `block_to_bytes`; raises EngineError on any malformed input."""
    if len(data) < HEADER.size:
        raise EngineError(f"KV block too short: {len(data)} bytes")
    magic, version, code, _, layers, heads, tokens, dim = HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION or code not in CODE_DTYPES:
        raise EngineError(f"not a KV block (magic {magic!r}, version {version}, dtype {code})")
    dtype = CODE_DTYPES[code]
    shape = (layers, 2, heads, tokens, dim)
    expected = HEADER.size + layers * 2 * heads * tokens * dim * dtype.itemsize
    if len(data) != expected:
        raise EngineError(f"KV block is {len(data)} bytes, its header says {expected}")
    raw = torch.frombuffer(bytearray(data[HEADER.size :]), dtype=torch.uint8)
    return raw.view(dtype).reshape(shape).to(device)


class SequenceKV:
    """The KV of one sequence: per layer a [2, kv_heads, capacity, head_dim] tensor of which
    the first `length` positions are valid. Grows by doubling. Its tensors are inference-mode
    tensors (no autograd), and every write runs in inference mode, so callers may fill it
    (e.g. layer-wise loading) from anywhere."""

    def __init__(
        self, spec: ModelSpec, dtype: torch.dtype, device: torch.device, capacity: int = 64
    ) -> None:
        self.spec, self.dtype, self.device = spec, dtype, device
        self.length = 0
        self.layers = [self._alloc(max(1, capacity)) for _ in range(spec.layers)]

    @torch.inference_mode()
    def _alloc(self, capacity: int) -> Tensor:
        shape = (2, self.spec.kv_heads, capacity, self.spec.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    @property
    def capacity(self) -> int:
        return self.layers[0].shape[2]

    @torch.inference_mode()
    def reserve(self, tokens: int) -> None:
        if tokens <= self.capacity:
            return
        new_cap = max(tokens, 2 * self.capacity)
        for i, old in enumerate(self.layers):
            grown = self._alloc(new_cap)
            grown[:, :, : old.shape[2]] = old
            self.layers[i] = grown

    @torch.inference_mode()
    def write(self, layer: int, start: int, k: Tensor, v: Tensor) -> None:
        """Store k, v [kv_heads, S, head_dim] at positions start..start+S-1 of `layer`."""
        end = start + k.shape[1]
        self.reserve(end)
        self.layers[layer][0, :, start:end] = k
        self.layers[layer][1, :, start:end] = v

    def view(self, layer: int, end: int) -> tuple[Tensor, Tensor]:
        kv = self.layers[layer]
        return kv[0, :, :end], kv[1, :, :end]

    def block(self, index: int, block_tokens: int) -> Tensor:
        """Block `index` as a tensor [layers, 2, kv_heads, block_tokens, head_dim]."""
        start, end = index * block_tokens, (index + 1) * block_tokens
        if end > self.length:
            raise EngineError(f"block {index} is not whole: only {self.length} tokens of KV")
        return torch.stack([kv[:, :, start:end] for kv in self.layers])

    @torch.inference_mode()
    def load_layer(self, layer: int, index: int, data: Tensor) -> None:
        """Write one layer [2, kv_heads, block_tokens, head_dim] of block `index` (for
        layer-wise loading); does not change `length`."""
        tokens = data.shape[2]
        self.reserve((index + 1) * tokens)
        self.layers[layer][:, :, index * tokens : (index + 1) * tokens] = data

    def check_block(self, block: Tensor) -> None:
        s = self.spec
        want = (s.layers, 2, s.kv_heads, s.head_dim)
        got = (block.shape[0], block.shape[1], block.shape[2], block.shape[4])
        if block.dim() != 5 or got != want:
            raise EngineError(f"KV block shape {tuple(block.shape)} does not fit this model")

    @classmethod
    @torch.inference_mode()
    def from_blocks(
        cls, spec: ModelSpec, blocks: list[Tensor], dtype: torch.dtype, device: torch.device
    ) -> SequenceKV:
        """A sequence KV holding the given consecutive whole blocks (the cached prefix)."""
        tokens = sum(b.shape[3] for b in blocks)
        kv = cls(spec, dtype, device, capacity=max(64, tokens + 64))
        start = 0
        for block in blocks:
            kv.check_block(block)
            n = block.shape[3]
            for layer in range(spec.layers):
                kv.layers[layer][:, :, start : start + n] = block[layer]
            start += n
        kv.length = tokens
        return kv

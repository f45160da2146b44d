"""The byte layout of a KV block: the one codec of the store's KV objects.

A block holds the KV of `block_tokens` consecutive tokens for every layer. Its bytes are

    header (32 bytes, little-endian, struct "<4sHBBIIII8x"):
        magic b"MCKV", version (1), dtype code (0 float32, 1 float16, 2 bfloat16), 0,
        layers, kv_heads, block_tokens, head_dim, 8 zero bytes
    payload: a C-contiguous array [layers, 2, kv_heads, block_tokens, head_dim]
        (layer-major; within a layer K then V), elements little-endian in that dtype.

K is stored after RoPE (as attention reads it), so a block is only valid at the positions it
was computed for: blocks are keyed by chained hashes (mooncake.hashing), which pin the prefix.

Layer i's K and V of a block are one contiguous byte range (`BlockLayout.layer_range`): what
lets a prefill load and store KV layer by layer (serving.kvstore). The partial last block of
a prompt is stored the same way with fewer tokens, which its header says.
"""

from __future__ import annotations

import struct
import sys
from dataclasses import dataclass

import torch
from torch import Tensor

from mooncake.engine.errors import EngineError

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


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """Byte layout of the KV block objects of one model."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def layer_bytes(self, tokens: int) -> int:
        """Bytes of one layer's K and V for `tokens` tokens."""
        return 2 * self.kv_heads * tokens * self.head_dim * self.dtype.itemsize

    def object_size(self, tokens: int) -> int:
        """Size of a block object holding `tokens` tokens (the header included)."""
        return HEADER.size + self.layers * self.layer_bytes(tokens)

    def layer_range(self, layer: int, tokens: int) -> tuple[int, int]:
        """(offset, length) of layer `layer`'s K and V inside a block object."""
        if not 0 <= layer < self.layers:
            raise IndexError(f"layer {layer} of a {self.layers}-layer model")
        n = self.layer_bytes(tokens)
        return HEADER.size + layer * n, n

    def header(self, tokens: int) -> bytes:
        """The object's first `HEADER.size` bytes (what `block_to_bytes` writes)."""
        code = DTYPE_CODES[self.dtype]
        return HEADER.pack(
            MAGIC, VERSION, code, 0, self.layers, self.kv_heads, tokens, self.head_dim
        )

    def payload(self, raw: Tensor, tokens: int) -> Tensor:
        """A whole object read into a uint8 tensor, checked against this layout, as its
        [layers, 2, kv_heads, tokens, head_dim] payload (a view, no copy); EngineError if
        its header says another layout."""
        if raw.numel() != self.object_size(tokens):
            raise EngineError(f"a KV object of {raw.numel()} bytes is not {tokens} tokens")
        if bytes(raw[: HEADER.size].numpy()) != self.header(tokens):
            raise EngineError(f"a KV object's header does not fit this model ({tokens} tokens)")
        body = raw[HEADER.size :].view(self.dtype)
        return body.view(self.layers, 2, self.kv_heads, tokens, self.head_dim)

"""The store's KV block objects are the engine's block bytes, cut into per-layer ranges."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from mooncake.engine import KVPool, ModelSpec, PagedKV, block_from_bytes, block_to_bytes
from mooncake.engine.kv import HEADER, BlockLayout
from mooncake.serving.kvstore import (
    Target,
    block_object,
    layer_piece,
    leading_hits,
    write_targets,
)

SPEC = ModelSpec(64, 32, 3, 4, 2, 64, 256)  # vocab, hidden, layers, heads, kv_heads, ffn, ctx


def random_kv(tokens: int, dtype: torch.dtype = torch.float32) -> tuple[PagedKV, Tensor]:
    """A sequence's KV in pages of a pool (4-token pages), and the same KV as a reference
    [layers, 2, kv_heads, tokens, head_dim] tensor."""
    pool = KVPool(SPEC, dtype, torch.device("cpu"), budget_bytes=1 << 20, page_tokens=4)
    kv = pool.sequence()
    assert kv.reserve(tokens)
    g = torch.Generator().manual_seed(1)
    ref = torch.randn((SPEC.layers, 2, SPEC.kv_heads, tokens, SPEC.head_dim), generator=g)
    ref = ref.to(dtype)
    for layer in range(SPEC.layers):
        kv.load_layer(layer, 0, ref[layer])
    kv.length = tokens
    return kv, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tokens", [8, 5])  # a whole block and a partial tail
def test_layer_ranges_cut_the_engine_block_bytes(dtype: torch.dtype, tokens: int) -> None:
    kv, ref = random_kv(16, dtype)
    layout = BlockLayout(SPEC.layers, SPEC.kv_heads, SPEC.head_dim, dtype)
    start = 8
    block = ref[:, :, :, start : start + tokens]
    data = block_to_bytes(block)
    assert len(data) == layout.object_size(tokens)
    assert data[: HEADER.size] == layout.header(tokens)
    assert block_object(kv, start, tokens) == data
    ends = []
    for layer in range(SPEC.layers):
        offset, length = layout.layer_range(layer, tokens)
        piece = layer_piece(kv, layer, start, tokens)
        assert piece.dtype == torch.uint8 and piece.numel() == length
        assert bytes(piece.numpy()) == data[offset : offset + length]
        ends.append(offset + length)
    # The ranges tile the payload exactly, layer after layer.
    assert ends[-1] == len(data)
    assert [layout.layer_range(i, tokens)[0] for i in range(1, SPEC.layers)] == ends[:-1]


def test_pieces_assemble_into_a_readable_block() -> None:
    kv, ref = random_kv(8)
    layout = BlockLayout(SPEC.layers, SPEC.kv_heads, SPEC.head_dim, torch.float32)
    buf = bytearray(layout.object_size(8))
    buf[: HEADER.size] = layout.header(8)
    for layer in reversed(range(SPEC.layers)):  # any order: ranges are independent
        offset, length = layout.layer_range(layer, 8)
        buf[offset : offset + length] = layer_piece(kv, layer, 0, 8).numpy().tobytes()
    block = block_from_bytes(bytes(buf))
    assert torch.equal(block, ref)


def test_layer_out_of_range() -> None:
    layout = BlockLayout(2, 1, 4, torch.float32)
    with pytest.raises(IndexError):
        layout.layer_range(2, 4)
    with pytest.raises(IndexError):
        layout.layer_range(-1, 4)


def test_write_targets_skip_loaded_blocks_and_add_the_tail() -> None:
    keys = ["a", "b", "c"]
    assert write_targets(keys, 30, 8, 1, "tail") == [
        Target("b", 8, 8),
        Target("c", 16, 8),
        Target("tail", 24, 6),
    ]
    assert write_targets(keys, 24, 8, 0, "tail") == [
        Target("a", 0, 8),
        Target("b", 8, 8),
        Target("c", 16, 8),
    ]
    assert write_targets([], 5, 8, 0, "t") == [Target("t", 0, 5)]


def test_leading_hits_stop_at_the_first_miss_or_wrong_size() -> None:
    assert leading_hits([10, 10, None, 10], 10) == 2
    assert leading_hits([10, 9, 10], 10) == 1
    assert leading_hits([], 10) == 0
    assert leading_hits([10, 10], 10) == 2

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


class _InstantStore:
    """A GetHandle whose reads land at once: the fill the loader sees is a block's header at
    offset 0 and a marker byte (the layer's number) everywhere else."""

    def __init__(self, layout: BlockLayout, tokens: int) -> None:
        self.layout, self.tokens = layout, tokens

    async def read(self, parts: list[tuple[str, int, object]]) -> list[bool]:
        for _key, offset, buf in parts:
            if offset == 0:
                memoryview(buf)[:] = self.layout.header(self.tokens)  # type: ignore[arg-type]
            else:
                layer = [self.layout.layer_range(i, self.tokens)[0] for i in range(SPEC.layers)]
                buf[:] = layer.index(offset) + 1  # type: ignore[index]
        return [True] * len(parts)


async def test_prefix_loader_reads_at_most_two_layers_ahead_of_the_compute(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reads are much faster than layers: the loader must stage no more than
    `read_ahead_layers` layers that the compute has not taken yet (it staged the whole prefix),
    and every layer still lands in the pages."""
    import asyncio
    import threading

    from mooncake.serving import kvstore
    from mooncake.serving.kvstore import PrefixLoader

    # 64 MiB would hold every layer of this tiny model: a window of two, as for a long prefix.
    monkeypatch.setattr(kvstore, "READ_AHEAD_BYTES", 1)

    layout = BlockLayout(SPEC.layers, SPEC.kv_heads, SPEC.head_dim, torch.float32)
    pool = KVPool(SPEC, torch.float32, torch.device("cpu"), budget_bytes=1 << 20, page_tokens=4)
    kv = pool.sequence()
    assert kv.reserve(16)
    keys = ["a", "b"]  # two blocks of 8 tokens
    loader = PrefixLoader(_InstantStore(layout, 8), keys, layout, 8, kv)  # type: ignore[arg-type]
    staged_most = 0

    def compute() -> None:
        nonlocal staged_most
        for layer in range(SPEC.layers):
            threading.Event().wait(0.05)  # a layer's compute: the reads could run far ahead
            staged_most = max(staged_most, sum(s is not None for s in loader._staged))
            loader.wait(layer, lambda: False)

    task = asyncio.create_task(loader.run())
    await asyncio.to_thread(compute)
    await task
    assert loader.error is None
    assert 1 <= staged_most <= kvstore.MIN_READ_AHEAD_LAYERS
    kv.length = 16
    for layer in range(SPEC.layers):
        assert bool((kv.layer_piece(layer, 0, 16).view(torch.uint8) == layer + 1).all())


def test_read_ahead_is_64_mib_of_layers_within_two_and_all() -> None:
    from mooncake.serving.kvstore import read_ahead_layers

    layer = 256 * 2 * 3 * 64 * 4  # a SmolLM2 block's layer: 256 tokens, K and V, 3 x 64 fp32
    assert read_ahead_layers(32, layer, 30) == 5  # an 8k-token prefix: 12 MiB a layer
    assert read_ahead_layers(2, layer, 30) == 30  # a short one: all of it
    assert read_ahead_layers(1000, layer, 30) == 2  # never fewer than two

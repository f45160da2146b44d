"""A chunked-pipeline stage's share of the prompt's KV in the store (issue 19, docs/cpp.md).

Each stage of a CPP group holds, in its own engine pool, the KV of its layer range only. The
store keeps a block as one object of every layer (`engine.kv.BlockLayout`), and a decode
worker reads it as from one prefill worker. So the group writes each block together: the
leader (stage 0) starts one put for the prompt's new blocks (`StoreClient.start_put`, the
objects `kvstore.write_targets` names) and sends its plan (`PutHandle.share`) with the stage
work; each other stage joins it (`StoreClient.join_put`). Every stage writes its layers of a
block as soon as the chunk that completes the block has run through them, stage 0 also the
objects' headers; the other stages report `written()`, and the leader `credit`s them and
commits. An object is published only once every layer of it is in: a stage that dies
leaves its blocks revoked, never half-written.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from mooncake.engine.kv import BlockLayout
from mooncake.engine.pool import PagedKV
from mooncake.serving.kvstore import Target, layer_piece
from mooncake.store.client import PutHandle


@dataclass(slots=True)
class StageBlockWriter:
    """Writes one stage's layers [first, end) of `targets` (in position order) into `put`,
    each block once the positions it covers are all computed (`chunk_done`)."""

    put: PutHandle
    layout: BlockLayout
    kv: PagedKV  # this stage's KV: its layers of positions 0 .. kv.length - 1
    layers: tuple[int, int]
    targets: Sequence[Target]
    header: bool  # the stage that holds layer 0 writes each object's header
    written_blocks: int = field(default=0, init=False)

    async def chunk_done(self, end: int) -> int:
        """Positions 0 .. `end` - 1 have run through this stage's layers: write every block
        not written yet that ends at or before `end`. Returns how many it wrote."""
        if end > self.kv.length:
            raise ValueError(f"positions up to {end} are not computed ({self.kv.length} are)")
        first, last = self.layers
        parts: list[tuple[str, int, object]] = []
        before = self.written_blocks
        while self.written_blocks < len(self.targets):
            t = self.targets[self.written_blocks]
            if t.start + t.tokens > end:
                break
            for layer in range(first, last):
                offset, _ = self.layout.layer_range(layer, t.tokens)
                parts.append((t.key, offset, layer_piece(self.kv, layer, t.start, t.tokens)))
            if self.header:
                parts.append((t.key, 0, self.layout.header(t.tokens)))
            self.written_blocks += 1
        if parts:
            await self.put.write(parts)
        return self.written_blocks - before

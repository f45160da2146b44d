"""One stage of a chunked-pipeline prefill (CPP, issue 19, docs/cpp.md): the prompt's chunks
through its layers (`run_stage`), and its share of the prompt's KV in the store
(`StageBlockWriter`).

`run_stage` is the loop every stage runs, wherever it runs (`bench cpp`'s stage processes,
a prefill worker serving a stage): stage 0 embeds the chunk's token ids, a later stage takes
the previous stage's activations from its `Inbox` (serving/activations.py: over the store's
transfer engine, never NATS); each chunk's output goes on to the next stage's inbox as soon
as it is computed (so stage s works on chunk k while stage s + 1 works on chunk k - 1), and
only then are the blocks it completed written; the last stage returns the last position's
logits.

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

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import Tensor

from mooncake.engine import compute
from mooncake.engine.engine import Engine
from mooncake.engine.kv import BlockLayout
from mooncake.engine.pool import PagedKV
from mooncake.engine.stage import run_chunk
from mooncake.memory import compute_heap
from mooncake.serving.activations import Aborted, Inbox, Outbox
from mooncake.serving.kvstore import Target, layer_piece
from mooncake.store.client import PutHandle
from mooncake.telemetry import tracer


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


async def run_stage(
    engine: Engine,
    kv: PagedKV,
    layers: tuple[int, int],
    chunks: Sequence[tuple[int, int]],
    tokens: Sequence[int],
    *,
    inbox: Inbox | None,
    outbox: Outbox | None,
    writer: StageBlockWriter | None = None,
    busy: list[float] | None = None,
    abort: asyncio.Event | None = None,
) -> Tensor | None:
    """Every chunk [a, b) of `tokens` through `layers`: from the token ids where `inbox` is
    None (stage 0), else from the activations it receives; each output to `outbox`, or, on
    the last stage (`outbox` None), the last chunk's last-position logits, returned. The
    compute runs in a worker thread (the event loop keeps moving activations and KV);
    `busy` gets each chunk's compute seconds; `abort` (set by whoever watches the group)
    stops it between chunks and in every wait (`activations.Aborted`)."""
    with compute_heap():  # one window over every chunk: no trim and refault between them
        logits = None
        for k, (a, b) in enumerate(chunks):
            chunk: Sequence[int] | Tensor = (
                tokens[a:b] if inbox is None else (await inbox.receive(abort=abort))[None]
            )
            if abort is not None and abort.is_set():
                raise Aborted("the pipeline was given up")
            final = outbox is None and k == len(chunks) - 1
            t0 = time.perf_counter()
            with tracer().start_as_current_span(
                "cpp chunk", attributes={"mc.cpp.chunk": k, "mc.cpp.start": a, "mc.cpp.end": b,
                                         "mc.cpp.layers": f"{layers[0]}-{layers[1]}"},
            ):  # fmt: skip
                out = await compute.run(run_chunk, engine, kv, layers, a, chunk, logits=final)
            if busy is not None:
                busy.append(time.perf_counter() - t0)
            if outbox is not None:
                # The next stage's input first: it is on the critical path.
                await outbox.send(out, abort=abort)
            elif final:
                logits = out
            if writer is not None:
                await writer.chunk_done(b)
        return logits

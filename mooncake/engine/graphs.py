"""Decode steps replayed from captured CUDA graphs, one per (batch, block-table width) bucket.

On a GPU an eager decode step is a few hundred small kernel launches issued by Python: for a
small model the launches, not the GPU, set the step time (the issue measured ~20 ms a step
whatever the model size). A CUDA graph records one step's launches once and replays them in
one call. A graph runs on fixed shapes and fixed addresses, so:

- a step of B sequences whose widest block table has W pages runs the graph of the smallest
  captured batch bucket >= B (`BATCH_BUCKETS`) and width bucket >= W (powers of two from
  `MIN_WIDTH`); rows past B are padding: they decode token 0 at position 0 into a scratch
  page held for this purpose alone (never a sequence's), and their logits are dropped;
- the step's inputs (token ids, positions, block tables) are copied into the graph's static
  tensors before the replay; everything else a step needs (page and offset of the new token,
  lengths, RoPE, the attention mask) is computed inside the graph from them, so the same
  math runs as in the eager step (`engine.paged.PagedDecode` over the same pool);
- a graph is captured the first time its bucket is met (`warm` captures a list up front, as
  a worker does at start), and where a bucket would gather more KV than `MAX_GATHER_TOKENS`
  the step runs eagerly instead.

The capture itself is a callable (`Capture`), so the bucketing, padding and static-input
logic runs and is tested on the CPU with an eager stand-in for the graph.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from mooncake.engine.model import Decoder
from mooncake.engine.paged import PagedDecode, block_table
from mooncake.engine.pool import KVPool, PagedKV

log = logging.getLogger("mooncake.engine.graphs")

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
MIN_WIDTH = 16  # pages: the narrowest block-table bucket
# A bucket whose padded gather (batch x width x page tokens) exceeds this runs eagerly: the
# portable attention copies every row's pages per layer, and a captured graph keeps that
# copy's memory for good.
MAX_GATHER_TOKENS = 1 << 20

Step = Callable[[], Tensor]
Capture = Callable[[Step], Step]  # records a step once; returns its replay


def batch_bucket(n: int) -> int | None:
    """The smallest batch bucket that holds n rows (None past the largest)."""
    return next((b for b in BATCH_BUCKETS if b >= n), None)


def width_bucket(pages: int) -> int:
    """The block-table width a step of tables up to `pages` pages runs at."""
    w = MIN_WIDTH
    while w < pages:
        w *= 2
    return w


def cuda_capture(pool: Any = None) -> Capture:
    """The real capture: warm the step up on a side stream (cuBLAS and allocator state),
    then record it into a CUDA graph sharing one memory pool with the other buckets."""

    def capture(step: Step) -> Step:
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = step()

        def replay() -> Tensor:
            graph.replay()
            return out

        return replay

    return capture


class _Bucket:
    """One captured step: its static inputs and the replay that writes its logits."""

    def __init__(self, model: Decoder, kv_pool: KVPool, batch: int, width: int) -> None:
        dev = kv_pool.device
        self.ids = torch.zeros((batch, 1), dtype=torch.long, device=dev)
        self.positions = torch.zeros(batch, dtype=torch.long, device=dev)
        self.table = torch.zeros((batch, width), dtype=torch.int32, device=dev)
        self.model, self.pool = model, kv_pool
        self.replay: Step | None = None

    def step(self) -> Tensor:
        backend = PagedDecode.of_tensors(self.pool, self.positions, self.table)
        logits: Tensor = self.model(self.ids, self.positions[:, None], backend)
        return logits


class GraphDecode:
    """Decode steps of `model` over `pool` from graphs made by `capture`."""

    def __init__(self, model: Decoder, pool: KVPool, capture: Capture) -> None:
        self.model, self.pool, self.capture = model, pool, capture
        scratch = pool.pages.alloc(1)
        if scratch is None:
            raise RuntimeError("the KV pool has no page left for the padding rows")
        self.scratch = scratch[0]  # held for the engine's life: padding writes land here
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        self.captured = 0

    @staticmethod
    def of(model: Decoder, pool: KVPool) -> GraphDecode | None:
        """Graph-captured steps where they apply (a CUDA device), else None."""
        if model.device.type != "cuda" or pool.device.type != "cuda":
            return None
        return GraphDecode(model, pool, cuda_capture(torch.cuda.graph_pool_handle()))

    def applies(self, batch: int, pages: int) -> bool:
        b = batch_bucket(batch)
        w = width_bucket(pages)
        return b is not None and b * w * self.pool.page_tokens <= MAX_GATHER_TOKENS

    def warm(
        self, batches: Sequence[int], pages: int, say: Callable[[str], None] = log.info
    ) -> int:
        """Capture the buckets of these batch sizes at the width of `pages` pages up front
        (a worker's start); returns how many were captured."""
        before = self.captured
        width = width_bucket(pages)
        for n in batches:
            if self.applies(n, width):
                self._bucket(batch_bucket(n) or n, width)
        say(f"decode graphs: {self.captured - before} captured (width {width} pages)")
        return self.captured - before

    def __call__(self, tokens: Sequence[int], kvs: Sequence[PagedKV]) -> Tensor:
        """Logits [len(kvs), V] of one decode step: token i at position kvs[i].length (its
        page reserved), exactly as `PagedDecode` computes it eagerly."""
        n = len(kvs)
        width = width_bucket(max(len(kv.pages) for kv in kvs))
        b = batch_bucket(n)
        assert b is not None
        bucket = self._bucket(b, width)
        ids = torch.zeros((b, 1), dtype=torch.long)
        positions = torch.zeros(b, dtype=torch.long)
        ids[:n, 0] = torch.tensor(list(tokens), dtype=torch.long)
        positions[:n] = torch.tensor([kv.length for kv in kvs], dtype=torch.long)
        table = block_table(kvs, b, width, fill=self.scratch)
        bucket.ids.copy_(ids, non_blocking=True)
        bucket.positions.copy_(positions, non_blocking=True)
        bucket.table.copy_(table, non_blocking=True)
        assert bucket.replay is not None
        return bucket.replay()[:n]

    def _bucket(self, batch: int, width: int) -> _Bucket:
        key = (batch, width)
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = _Bucket(self.model, self.pool, batch, width)
            bucket.table.fill_(self.scratch)  # the warm-up steps write the scratch page only
            with torch.inference_mode():
                bucket.replay = self.capture(bucket.step)
            self.buckets[key] = bucket
            self.captured += 1
        return bucket

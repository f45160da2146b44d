"""Engine KV <-> store objects, layer by layer (the pieces; `prefill_kv` runs a prefill with
them, `decode_kv` loads a decode request's prompt).

A KV block object in the store is exactly the engine's block bytes (`engine.kv`, the one
codec: a 32-byte header, then [layers, 2, kv_heads, tokens, head_dim]), so layer i's K and V
of a block are one contiguous byte range (`BlockLayout.layer_range`). That is what lets a
prefill

- load layer i of every cached block just before layer i runs (`PrefixLoader`: the reads of
  later layers are in flight while earlier layers compute), and
- write layer i of every new block as soon as layer i is computed (`BlockWriter`: one
  two-phase put for all new blocks; readers never see a block before `commit`).

The partial last block of a prompt (fewer than `block_tokens` tokens) is stored too, under a
request-scoped key, as a block whose header says how many tokens it holds, so the decode side
gets the whole prompt's KV from the store. A sequence's KV is read from and written to its
pages in the engine's pool (`engine.pool`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from mooncake.engine import PagedKV
from mooncake.engine.kv import HEADER, BlockLayout, block_to_bytes
from mooncake.store.client import GetHandle, PutHandle, StoreError

log = logging.getLogger("mooncake.serving.kvstore")

# How long the compute thread waits for one layer of the cached prefix before it gives up on
# the prefix (and recomputes it): far above any sane transfer, below the leases' lifetime.
LOAD_WAIT_S = 30.0
POLL_S = 0.05  # the compute thread's waits wake this often to notice a cancellation
# A prefix loader stages at most this many bytes of layers the compute has not taken yet
# (and at least two layers: one being read while the compute takes the other).
READ_AHEAD_BYTES = 64 << 20
MIN_READ_AHEAD_LAYERS = 2


def read_ahead_layers(blocks: int, layer_bytes: int, layers: int) -> int:
    """How many layers of `blocks` cached blocks (`layer_bytes` each per block) a prefix
    loader may stage at once: READ_AHEAD_BYTES worth, at least MIN_READ_AHEAD_LAYERS, at
    most all of them. A deep window hides the per-layer round trip (read, hand-over to the
    compute thread) when layers compute quickly (a prompt mostly cached)."""
    fit = READ_AHEAD_BYTES // max(blocks * layer_bytes, 1)
    return max(MIN_READ_AHEAD_LAYERS, min(layers, fit))


# Where a prompt token's KV came from (the tiers of the cache hit rate, and the miss):
# the engine's own pool, this node's DRAM, another node's DRAM, SSD, or nowhere.
ENGINE, LOCAL_DRAM, REMOTE_DRAM, SSD = "engine", "local_dram", "remote_dram", "ssd"
COMPUTED = "computed"
TIERS = (ENGINE, LOCAL_DRAM, REMOTE_DRAM, SSD, COMPUTED)


# --- pieces of a sequence's KV as store bytes (pure) ---------------------------------------


def layer_piece(kv: PagedKV, layer: int, start: int, tokens: int) -> Tensor:
    """Layer `layer`'s K and V of positions start..start+tokens-1, as the flat bytes of that
    layer's range in a block object (a new CPU tensor: the caller may keep it)."""
    piece = kv.layer_piece(layer, start, tokens)
    return piece.to("cpu").contiguous().view(torch.uint8).reshape(-1)


def block_object(kv: PagedKV, start: int, tokens: int) -> bytes:
    """The whole object of a block (or the partial tail) starting at position `start`."""
    return block_to_bytes(kv.piece(start, tokens))


@dataclass(frozen=True, slots=True)
class Target:
    """A block object a prefill writes: its key and the positions it covers."""

    key: str
    start: int
    tokens: int


def write_targets(
    keys: Sequence[str], prompt_tokens: int, block_tokens: int, first: int, tail_key: str
) -> list[Target]:
    """The objects a prefill that loaded the first `first` blocks must write: every later
    whole block under its chained key, then the partial tail (if any) under `tail_key`."""
    out = [Target(k, j * block_tokens, block_tokens) for j, k in enumerate(keys) if j >= first]
    tail = prompt_tokens - len(keys) * block_tokens
    if tail > 0:
        out.append(Target(tail_key, len(keys) * block_tokens, tail))
    return out


def source_tier(segment_id: str, local_segment: str | None) -> str:
    """The tier a block read from `segment_id` comes from, seen from the node that owns
    `local_segment`. Store nodes name their segments `<node>-dram` and `<node>-ssd`
    (`store.node`), which is how an SSD segment is told apart here."""
    if segment_id == local_segment:
        return LOCAL_DRAM
    if segment_id.endswith("-ssd"):
        return SSD
    return REMOTE_DRAM


def loaded_tiers(
    handle: GetHandle, keys: Sequence[str], local_segment: str | None
) -> dict[str, int]:
    """Blocks per tier for the cached blocks `keys` that `handle` found: each block counts
    where its read goes, the replica the handle ranks first (local transports before tcp,
    DRAM before SSD); a read that falls back to another replica is still counted there."""
    tiers: dict[str, int] = {}
    for key in keys:
        # GetHandle has no public accessor for its ranked replicas (store is not ours to
        # change here); it keeps key -> (size, [(transport, endpoint, region), ...]).
        _size, candidates = handle._found[key]
        tier = source_tier(candidates[0][2].segment_id, local_segment)
        tiers[tier] = tiers.get(tier, 0) + 1
    return tiers


def leading_hits(sizes: Sequence[int | None], size: int) -> int:
    """How many leading objects were found with the expected size (the usable prefix)."""
    n = 0
    for s in sizes:
        if s != size:
            break
        n += 1
    return n


# --- errors -------------------------------------------------------------------------------


class PrefillCancelled(Exception):
    """The request was cancelled (or the caller gave up): raised at a layer boundary."""


class PrefixLoadError(Exception):
    """A cached block could not be read (node gone, lease lost, bad bytes)."""


class KvWriteError(StoreError):
    """The prompt's KV could not be stored (transient: the work is retried)."""


# --- loading a cached prefix layer by layer ---------------------------------------------------


class PrefixLoader:
    """Reads cached blocks from the store into a sequence's pages, layer by layer.

    `keys` are blocks `first`, `first + 1`, ... of the prompt. `run` (event loop) reads the
    layers in order, each as one batched read of that layer's range of every block; `wait(i)`
    (compute thread, from `before_layer`) blocks until layer i has arrived and copies it into
    the blocks' pages. Later layers' reads are in flight while layer i runs, and reads stay
    `read_ahead_layers` ahead of the compute (64 MiB of staging): reads are far faster than
    layers, so unbounded they staged the whole cached prefix at once (an 8k-token prefix of
    SmolLM2 is ~350 MiB of staging on top of its pages).
    """

    def __init__(
        self,
        handle: GetHandle,
        keys: Sequence[str],
        layout: BlockLayout,
        block_tokens: int,
        kv: PagedKV,
        first: int = 0,
    ) -> None:
        self._handle, self.keys = handle, list(keys)
        self._layout, self._tokens, self._kv = layout, block_tokens, kv
        per = block_tokens // kv.pool.page_tokens
        self._pages = kv.table()[first * per : (first + len(self.keys)) * per]
        self._ready = [threading.Event() for _ in range(layout.layers)]
        self._staged: list[Tensor | None] = [None] * layout.layers
        self.error: str | None = None
        self.loaded_at: list[float] = [0.0] * layout.layers  # monotonic, for tests and spans
        self._window: asyncio.Semaphore | None = None  # layers staged and not yet consumed
        self._loop: asyncio.AbstractEventLoop | None = None

    async def run(self) -> None:
        ahead = read_ahead_layers(
            len(self.keys), self._layout.layer_bytes(self._tokens), self._layout.layers
        )
        self._loop, self._window = asyncio.get_running_loop(), asyncio.Semaphore(ahead)
        try:
            for layer in range(self._layout.layers):
                await self._window.acquire()  # given back as the compute consumes a layer
                if not await self._read_layer(layer):
                    return
        except Exception as exc:  # any failure: the prefill recomputes instead
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            for ready in self._ready:  # never leave the compute thread waiting
                ready.set()

    async def _read_layer(self, layer: int) -> bool:
        offset, length = self._layout.layer_range(layer, self._tokens)
        staged = torch.empty((len(self.keys), length), dtype=torch.uint8)
        parts: list[tuple[str, int, object]] = [
            (k, offset, staged[j]) for j, k in enumerate(self.keys)
        ]
        headers = [bytearray(HEADER.size) for _ in self.keys] if layer == 0 else []
        parts += [(k, 0, h) for k, h in zip(self.keys, headers, strict=False)]
        ok = await self._handle.read(parts)
        if not all(ok):
            self.error = f"layer {layer} of the cached prefix could not be read"
            return False
        want = self._layout.header(self._tokens)
        if any(bytes(h) != want for h in headers):
            self.error = "a cached block's header does not fit this model"
            return False
        self._staged[layer] = staged
        self.loaded_at[layer] = time.monotonic()
        self._ready[layer].set()
        return True

    async def fill(self) -> None:
        """Read every layer and put it into the pages at once, one layer staged at a time
        (a decode instance loading a prompt: nothing computes meanwhile); PrefixLoadError
        if a layer cannot be read or does not fit this model."""
        for layer in range(self._layout.layers):
            if not await self._read_layer(layer):
                raise PrefixLoadError(self.error or f"layer {layer} could not be read")
            await asyncio.to_thread(self._put, layer)

    def wait(self, layer: int, stopped: Callable[[], bool]) -> None:
        """Compute thread: block until layer `layer` is loaded, then put it into the KV."""
        deadline = time.monotonic() + LOAD_WAIT_S
        while not self._ready[layer].wait(POLL_S):
            if stopped():
                raise PrefillCancelled("cancelled while loading the prefix")
            if time.monotonic() > deadline:
                raise PrefixLoadError(f"layer {layer} of the prefix did not arrive in time")
        try:
            self._put(layer)
        finally:
            self._consumed()

    def _consumed(self) -> None:
        """Compute thread: a staged layer is gone, `run` may read one more."""
        loop, window = self._loop, self._window
        if loop is not None and window is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing reads on
                loop.call_soon_threadsafe(window.release)

    def _put(self, layer: int) -> None:
        staged, self._staged[layer] = self._staged[layer], None
        if staged is None:
            raise PrefixLoadError(self.error or f"layer {layer} of the prefix was not loaded")
        lay = self._layout
        blocks = staged.view(lay.dtype).view(len(self.keys), 2, lay.kv_heads, -1, lay.head_dim)
        self._kv.pool.write_blocks(layer, self._pages, blocks)


# --- writing new blocks layer by layer --------------------------------------------------------


class BlockWriter:
    """Streams the new blocks of a prefill into one two-phase put, layer by layer.

    `layer_done(i)` (compute thread, from `after_layer`) cuts layer i's range of every target
    out of the KV and queues it; `run` (event loop) writes the queued layers in order.
    """

    def __init__(
        self,
        put: PutHandle,
        layout: BlockLayout,
        kv: PagedKV,
        targets: Sequence[Target],
        loop: asyncio.AbstractEventLoop,
    ) -> None:
        self._put, self._layout, self._kv = put, layout, kv
        self.targets = list(targets)
        self._loop = loop
        self._queue: asyncio.Queue[tuple[int, list[tuple[str, int, object]]] | None] = (
            asyncio.Queue()
        )
        self.written_at: dict[int, float] = {}  # layer -> monotonic time its write finished

    def layer_done(self, layer: int) -> None:
        if not self.targets:
            return
        parts: list[tuple[str, int, object]] = []
        for t in self.targets:
            offset, _ = self._layout.layer_range(layer, t.tokens)
            parts.append((t.key, offset, layer_piece(self._kv, layer, t.start, t.tokens)))
            if layer == 0:
                parts.append((t.key, 0, self._layout.header(t.tokens)))
        self._loop.call_soon_threadsafe(self._queue.put_nowait, (layer, parts))

    def close(self) -> None:
        """Event loop: no more layers will come."""
        self._queue.put_nowait(None)

    async def run(self) -> None:
        while (item := await self._queue.get()) is not None:
            layer, parts = item
            await self._put.write(parts)
            self.written_at[layer] = time.monotonic()

"""Engine KV <-> store objects, layer by layer.

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
gets the whole prompt's KV from the store.

The prompt's KV lives in pages of the engine's pool (`engine.pool`). Leading blocks the pool
still caches (an earlier prompt with the same prefix, on this instance) are shared, neither
loaded nor computed: the "engine" tier, ahead of the store's DRAM. After the prefill every
whole block of the prompt is offered to the pool's cache in turn.

The engine is synchronous torch: `prefill_with_store` runs it in a worker thread and the
hooks hand work to the event loop, so store I/O overlaps compute and the loop stays free.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from mooncake.engine import Engine, KVPoolExhausted, PagedKV, Prefilled
from mooncake.engine.kv import HEADER, BlockLayout, block_to_bytes
from mooncake.store import protocol as p
from mooncake.store.client import GetHandle, PutHandle, StoreClient, StoreError
from mooncake.store.types import Reason

log = logging.getLogger("mooncake.serving.kvstore")

# How long the compute thread waits for one layer of the cached prefix before it gives up on
# the prefix (and recomputes it): far above any sane transfer, below the leases' lifetime.
LOAD_WAIT_S = 30.0
POLL_S = 0.05  # the compute thread's waits wake this often to notice a cancellation

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
    the blocks' pages. Layer i+1's read is in flight while layer i runs.
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

    async def run(self) -> None:
        try:
            for layer in range(self._layout.layers):
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

    def wait(self, layer: int, stopped: Callable[[], bool]) -> None:
        """Compute thread: block until layer `layer` is loaded, then put it into the KV."""
        deadline = time.monotonic() + LOAD_WAIT_S
        while not self._ready[layer].wait(POLL_S):
            if stopped():
                raise PrefillCancelled("cancelled while loading the prefix")
            if time.monotonic() > deadline:
                raise PrefixLoadError(f"layer {layer} of the prefix did not arrive in time")
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


class _Hooks:
    """The engine's LayerHooks for a prefill against the store (compute thread side)."""

    def __init__(
        self,
        loader: PrefixLoader | None,
        writer: BlockWriter,
        cancelled: threading.Event,
        abandoned: threading.Event,
    ) -> None:
        self._loader, self._writer = loader, writer
        self._cancelled, self._abandoned = cancelled, abandoned
        self.computed_at: dict[int, float] = {}

    def _stopped(self) -> bool:
        return self._cancelled.is_set() or self._abandoned.is_set()

    def _check(self) -> None:
        if self._stopped():
            raise PrefillCancelled("prefill stopped at a layer boundary")

    def before_layer(self, layer: int) -> None:
        self._check()
        if self._loader is not None:
            self._loader.wait(layer, self._stopped)

    def after_layer(self, layer: int, k: Tensor, v: Tensor) -> None:
        self.computed_at[layer] = time.monotonic()
        self._writer.layer_done(layer)
        self._check()


# --- one prefill against the store ------------------------------------------------------------


@dataclass
class StoredPrefill:
    """A prefill whose KV is in the store: every whole block under its chained key, the
    partial tail (if any) under `tail_key`."""

    prefilled: Prefilled
    block_keys: list[str]
    loaded_blocks: int  # leading blocks read from the store instead of computed
    tail_key: str | None
    tail_tokens: int
    written: list[str]  # objects this prefill wrote (the others were stored already)
    load_fallback: str | None = None  # why the cached prefix was dropped and recomputed
    # Monotonic stamps per layer: computed (after_layer), written (put piece done), loaded.
    computed_at: dict[int, float] = field(default_factory=dict)
    written_at: dict[int, float] = field(default_factory=dict)
    loaded_at: list[float] = field(default_factory=list)
    loaded_from: dict[str, int] = field(default_factory=dict)  # tier -> loaded blocks

    def release(self) -> None:
        """Give the prompt's pages back to the pool (its published blocks stay cached)."""
        self.prefilled.kv.release()

    def tokens_by_tier(self, prompt_tokens: int, block_tokens: int) -> dict[str, int]:
        """Prompt tokens per tier their KV came from (`TIERS`); they add up to the prompt."""
        out = dict.fromkeys(TIERS, 0)
        for tier, blocks in self.loaded_from.items():
            out[tier] += blocks * block_tokens
        out[COMPUTED] = prompt_tokens - self.loaded_blocks * block_tokens
        return out


async def prefill_with_store(
    engine: Engine,
    store: StoreClient,
    tokens: Sequence[int],
    *,
    cached_blocks: int,
    tail_key: str,
    preferred_segment: str | None,
    cancelled: threading.Event,
) -> StoredPrefill:
    """Prefill `tokens`, loading up to `cached_blocks` leading blocks from the store and
    writing every other block (and the tail) to it while computing.

    Raises EngineError (bad input: before any store I/O), PrefillCancelled (`cancelled` was
    set: the put is revoked), StoreError/KvWriteError (transient). A cached prefix that cannot
    be read is recomputed rather than failing the request.
    """
    tokens = [int(t) for t in tokens]
    engine.check_tokens(tokens)
    try:
        return await _prefill_once(
            engine, store, tokens, cached_blocks, tail_key, preferred_segment, cancelled
        )
    except PrefixLoadError as exc:
        log.warning("cached prefix unusable (%s): recomputing it", exc)
        # -1: load nothing, compute the whole prompt.
        done = await _prefill_once(
            engine, store, tokens, -1, tail_key, preferred_segment, cancelled
        )
        done.load_fallback = str(exc)
        return done


async def _open_prefix(
    store: StoreClient, keys: Sequence[str], size: int
) -> tuple[GetHandle | None, int]:
    """A lookup of `keys` and how many of them, from the first, the store holds whole."""
    if not keys:
        return None, 0
    handle = await store.start_get(keys)
    return handle, leading_hits([handle.size(k) for k in keys], size)


async def _prefill_once(
    engine: Engine,
    store: StoreClient,
    tokens: list[int],
    cached_blocks: int,
    tail_key: str,
    preferred_segment: str | None,
    cancelled: threading.Event,
) -> StoredPrefill:
    layout, size_t = engine.layout, engine.block_tokens
    keys = engine.block_keys(tokens)
    # The Conductor's `cached_blocks` was its view at admission; blocks stored since (by a
    # request admitted just before this one) are in the pool too: look up every usable
    # leading block (one round trip) and load the prefix actually there.
    usable = engine.usable_cached_blocks(len(tokens), len(keys))
    kv = engine.new_kv()
    try:
        pooled = kv.adopt_cached(keys[:usable])  # the engine tier: shared pages, no I/O
        want = usable if cached_blocks >= 0 else pooled
        handle, in_store = await _open_prefix(store, keys[:want], layout.object_size(size_t))
        n = max(pooled, in_store)
        if not kv.reserve(len(tokens)):
            raise KVPoolExhausted(f"no room in the KV pool for a prompt of {len(tokens)} tokens")
        kv.length = n * size_t  # filled layer by layer by the loader, before each layer reads it
        done = await _compute_and_store(
            engine, store, kv, tokens, keys, (pooled, in_store, n), handle,
            tail_key, preferred_segment, cancelled,
        )  # fmt: skip
    except BaseException:
        kv.release()
        raise
    kv.publish_blocks(keys, size_t)
    return done


async def _compute_and_store(
    engine: Engine,
    store: StoreClient,
    kv: PagedKV,
    tokens: list[int],
    keys: list[str],
    counts: tuple[int, int, int],
    handle: GetHandle | None,
    tail_key: str,
    preferred_segment: str | None,
    cancelled: threading.Event,
) -> StoredPrefill:
    """Load blocks pooled..n-1 from the store, compute the rest, and write every block the
    store lacks (from `in_store` on: pooled ones too) and the tail while computing."""
    pooled, in_store, n = counts
    layout, size_t = engine.layout, engine.block_tokens
    loader = None
    loaded_from = {ENGINE: pooled} if pooled else {}
    if handle is not None and n > pooled:
        loader = PrefixLoader(handle, keys[pooled:n], layout, size_t, kv, first=pooled)
        for tier, count in loaded_tiers(handle, keys[pooled:n], preferred_segment).items():
            loaded_from[tier] = loaded_from.get(tier, 0) + count
    targets = write_targets(keys, len(tokens), size_t, in_store, tail_key)
    put = await store.start_put(
        [(t.key, layout.object_size(t.tokens)) for t in targets],
        preferred_segment=preferred_segment,
    )
    loop = asyncio.get_running_loop()
    writer = BlockWriter(put, layout, kv, [t for t in targets if t.key in put.keys], loop)
    abandoned = threading.Event()
    hooks = _Hooks(loader, writer, cancelled, abandoned)
    tasks = [asyncio.create_task(writer.run())]
    if loader is not None:
        tasks.append(asyncio.create_task(loader.run()))
    try:
        prefilled = await asyncio.to_thread(engine.prefill, tokens, kv, hooks)
        writer.close()
        await tasks[0]
        results = await put.commit()
    except BaseException:
        abandoned.set()  # a cancelled await leaves the thread running: stop it at a layer
        for t in tasks:
            t.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*tasks, return_exceptions=True)
        await put.abort()
        raise
    finally:
        for t in tasks[1:]:
            t.cancel()
    await _ensure_stored(store, kv, targets, results, preferred_segment)
    tail = targets[-1] if targets and targets[-1].key == tail_key else None
    return StoredPrefill(
        prefilled=prefilled,
        block_keys=keys,
        loaded_blocks=n,
        tail_key=tail_key if tail is not None else None,
        tail_tokens=tail.tokens if tail is not None else 0,
        written=[t.key for t in writer.targets if results.get(t.key) is None],
        computed_at=hooks.computed_at,
        written_at=writer.written_at,
        loaded_at=loader.loaded_at if loader is not None else [],
        loaded_from=loaded_from,
    )


async def _ensure_stored(
    store: StoreClient,
    kv: PagedKV,
    targets: Sequence[Target],
    results: dict[str, p.Refused | None],
    preferred_segment: str | None,
) -> None:
    """Every target must be in the store when the prefill reports its keys.

    A key refused as EXISTS was stored by an earlier request (or is being stored by a
    concurrent one: then it is complete soon). Anything else that did not land (a piece that
    failed, no space at start) is put again whole from the KV we still hold.
    """
    missing = [t for t in targets if results.get(t.key) is not None]
    if not missing:
        return
    exists = await store.exists_many([t.key for t in missing])
    again = [t for t, present in zip(missing, exists, strict=True) if not present]
    if not again:
        return
    items = [(t.key, block_object(kv, t.start, t.tokens)) for t in again]
    refused = await store.put_many(items, preferred_segment=preferred_segment)
    bad = [
        f"{t.key}: {r.reason.value}"
        for t, r in zip(again, refused, strict=True)
        if r is not None and r.reason is not Reason.EXISTS
    ]
    if bad:
        raise KvWriteError(f"{len(bad)} KV objects could not be stored: {'; '.join(bad[:3])}")


async def replicate_blocks(
    store: StoreClient,
    kv: PagedKV,
    keys: Sequence[tuple[str, int]],
    block_tokens: int,
    segment: str,
) -> int:
    """Hot-block replication (PAPER.md §3): put copies of blocks fetched from a remote node
    into this instance's own segment. `keys` are (key, block index). Returns how many copies
    were placed. Best effort: a refusal is not an error.

    The master refuses a second put of a stored key (EXISTS) and has no "add a replica" op
    yet, so until it does, copies of already-stored keys are refused and counted out.
    """
    if not keys:
        return 0
    items = await asyncio.to_thread(
        lambda: [(k, block_object(kv, j * block_tokens, block_tokens)) for k, j in keys]
    )
    refused = await store.put_many(items, preferred_segment=segment)
    return sum(r is None for r in refused)

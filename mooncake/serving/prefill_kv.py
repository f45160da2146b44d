"""One prefill against the store and the engine's pool (the prefill worker's core).

The prompt's KV lives in pages of the engine's pool (`engine.pool`). Leading blocks the pool
still caches (an earlier prompt with the same prefix, on this instance) are shared, neither
loaded nor computed: the "engine" tier, ahead of the store's DRAM. The next blocks the store
holds are loaded layer by layer just ahead of the layer that reads them (`PrefixLoader`);
the rest is computed, and every block the store lacks (and the partial tail, under a
request-scoped key) is written layer by layer while computing (`BlockWriter`). After the
prefill every whole block of the prompt is offered to the pool's cache.

The engine is synchronous torch: `prefill_with_store` runs it in a worker thread and the
hooks hand work to the event loop, so store I/O overlaps compute and the loop stays free.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import Tensor

from mooncake.aio import cancel_all
from mooncake.engine import Engine, KVPoolExhausted, PagedKV, Prefilled, compute
from mooncake.hashing import DEFAULT_CACHE_NAMESPACE
from mooncake.serving.kvstore import (
    COMPUTED,
    ENGINE,
    TIERS,
    BlockWriter,
    KvWriteError,
    PrefillCancelled,
    PrefixLoader,
    PrefixLoadError,
    Target,
    block_object,
    leading_hits,
    loaded_tiers,
    write_targets,
)
from mooncake.store import protocol as p
from mooncake.store.client import GetHandle, StoreClient
from mooncake.store.types import Reason

log = logging.getLogger("mooncake.serving.kvstore")


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


@dataclass(frozen=True)
class _Dest:
    """Where a prefill's objects go: the segment it prefers, and the cache namespace they
    are keyed in, which owns them in the store (its quota counts them)."""

    segment: str | None
    owner: str


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
    namespace: str = DEFAULT_CACHE_NAMESPACE  # its blocks' cache namespace (their owner)

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
    namespace: str = DEFAULT_CACHE_NAMESPACE,
    load_limit: int | None = None,
) -> StoredPrefill:
    """Prefill `tokens`, loading the leading blocks the store holds (`cached_blocks` is the
    Conductor's view of them; -1: none) and writing every other block (and the tail) to it
    while computing; its blocks are keyed in the request's cache `namespace`
    (`hashing.cache_namespace`), which owns them in the store (its quota counts them).
    `load_limit`: load no more than that many blocks from the store (the Conductor judged
    computing the rest of the prefix faster than loading it); blocks this engine's pool
    still caches are used whatever the limit, since they cost no load.

    Raises EngineError (bad input: before any store I/O), PrefillCancelled (`cancelled` was
    set: the put is revoked), StoreError/KvWriteError (transient). A cached prefix that cannot
    be read is recomputed rather than failing the request.
    """
    tokens = [int(t) for t in tokens]
    engine.check_tokens(tokens)
    keys = engine.block_keys(tokens, namespace)
    dest = _Dest(preferred_segment, namespace)
    try:
        return await _prefill_once(
            engine, store, tokens, keys, cached_blocks, tail_key, dest, cancelled, load_limit
        )
    except PrefixLoadError as exc:
        log.warning("cached prefix unusable (%s): recomputing it", exc)
        # -1: load nothing, compute the whole prompt.
        done = await _prefill_once(engine, store, tokens, keys, -1, tail_key, dest, cancelled)
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
    keys: list[str],
    cached_blocks: int,
    tail_key: str,
    dest: _Dest,
    cancelled: threading.Event,
    load_limit: int | None = None,
) -> StoredPrefill:
    layout, size_t = engine.layout, engine.block_tokens
    # The Conductor's `cached_blocks` was its view at admission; blocks stored since (by a
    # request admitted just before this one) are in the pool too: look up every usable
    # leading block (one round trip) and load the prefix actually there.
    usable = engine.usable_cached_blocks(len(tokens), len(keys))
    kv = engine.new_kv()
    try:
        pooled = kv.adopt_cached(keys[:usable])  # the engine tier: shared pages, no I/O
        want = usable if cached_blocks >= 0 else pooled
        if load_limit is not None:
            want = max(pooled, min(want, load_limit))
        handle, in_store = await _open_prefix(store, keys[:want], layout.object_size(size_t))
        n = max(pooled, in_store)
        if not kv.reserve(len(tokens)):
            raise KVPoolExhausted(f"no room in the KV pool for a prompt of {len(tokens)} tokens")
        kv.length = n * size_t  # filled layer by layer by the loader, before each layer reads it
        done = await _compute_and_store(
            engine, store, kv, tokens, keys, (pooled, in_store, n), handle,
            tail_key, dest, cancelled,
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
    dest: _Dest,
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
        for tier, count in loaded_tiers(handle, keys[pooled:n], dest.segment).items():
            loaded_from[tier] = loaded_from.get(tier, 0) + count
    targets = write_targets(keys, len(tokens), size_t, in_store, tail_key)
    put = await store.start_put(
        [(t.key, layout.object_size(t.tokens)) for t in targets],
        preferred_segment=dest.segment,
        owner=dest.owner,
    )
    loop = asyncio.get_running_loop()
    writer = BlockWriter(put, layout, kv, [t for t in targets if t.key in put.keys], loop)
    abandoned = threading.Event()
    hooks = _Hooks(loader, writer, cancelled, abandoned)
    tasks = [asyncio.create_task(writer.run())]
    if loader is not None:
        tasks.append(asyncio.create_task(loader.run()))
    try:
        prefilled = await compute.run(engine.prefill, tokens, kv, hooks)
        writer.close()
        await tasks[0]
        results = await put.commit()
    except BaseException:
        abandoned.set()  # a cancelled await leaves the thread running: stop it at a layer
        with contextlib.suppress(BaseException):
            await cancel_all(tasks)
        await put.abort()
        raise
    finally:
        for t in tasks[1:]:
            t.cancel()
    await _ensure_stored(store, kv, targets, results, dest)
    tail = targets[-1] if targets and targets[-1].key == tail_key else None
    return StoredPrefill(
        prefilled=prefilled, block_keys=keys, loaded_blocks=n,
        tail_key=tail_key if tail is not None else None,
        tail_tokens=tail.tokens if tail is not None else 0,
        written=[t.key for t in writer.targets if results.get(t.key) is None],
        computed_at=hooks.computed_at, written_at=writer.written_at,
        loaded_at=loader.loaded_at if loader is not None else [], loaded_from=loaded_from,
        namespace=dest.owner,
    )  # fmt: skip


async def _ensure_stored(
    store: StoreClient,
    kv: PagedKV,
    targets: Sequence[Target],
    results: dict[str, p.Refused | None],
    dest: _Dest,
) -> None:
    """Every target must be in the store when the prefill reports its keys.

    A key refused as EXISTS was stored by an earlier request (or is being stored by a
    concurrent one: then it is complete soon). Anything else that did not land (a piece that
    failed, no space at start) is put again whole from the KV we still hold. A key refused
    for its namespace's quota (every object of the namespace leased or in flight) is left
    out: trying again would not help, and the decode computes a prompt's KV it cannot load.
    """
    missing = [t for t in targets if results.get(t.key) is not None]
    if not missing:
        return
    exists = await store.exists_many([t.key for t in missing])
    again = [t for t, present in zip(missing, exists, strict=True) if not present]
    if not again:
        return
    bad: list[str] = []
    over_quota = 0
    for batch in _batches(again, kv.pool.shape.page_bytes // kv.pool.page_tokens):
        # A batch's objects are serialized on their way out: bounded, not the whole prompt.
        items = _objects(kv, batch)
        refused = await store.put_many(items, preferred_segment=dest.segment, owner=dest.owner)
        for t, r in zip(batch, refused, strict=True):
            if r is None or r.reason is Reason.EXISTS:
                continue
            if r.reason is Reason.QUOTA:
                over_quota += 1
            else:
                bad.append(f"{t.key}: {r.reason.value}")
    if over_quota:
        log.info(
            "%d KV objects not stored: namespace %s is at its quota (the decode computes them)",
            over_quota, dest.owner,
        )  # fmt: skip
    if bad:
        raise KvWriteError(f"{len(bad)} KV objects could not be stored: {'; '.join(bad[:3])}")


REPUT_BATCH_BYTES = 64 << 20


def _batches(targets: Sequence[Target], bytes_per_token: int) -> list[list[Target]]:
    """Targets in runs of at most REPUT_BATCH_BYTES of KV (at least one each)."""
    out: list[list[Target]] = [[]]
    size = 0
    for t in targets:
        n = t.tokens * bytes_per_token
        if out[-1] and size + n > REPUT_BATCH_BYTES:
            out.append([])
            size = 0
        out[-1].append(t)
        size += n
    return [b for b in out if b]


async def replicate_blocks(
    store: StoreClient,
    kv: PagedKV,
    keys: Sequence[tuple[str, int]],
    block_tokens: int,
    segment: str,
    namespace: str = DEFAULT_CACHE_NAMESPACE,
) -> int:
    """Hot-block replication (PAPER.md §3): put copies of blocks fetched from a remote node
    into this instance's own segment. `keys` are (key, block index) in the cache `namespace`
    (`StoredPrefill.namespace`: their owner). Returns how many copies were placed. Best
    effort: a refusal is not an error.

    The master refuses a second put of a stored key (EXISTS) and has no "add a replica" op
    yet, so until it does, copies of already-stored keys are refused and counted out.
    """
    if not keys:
        return 0
    # Serialize only what the master would take (not the stored keys it refuses).
    exists = await store.exists_many([k for k, _ in keys])
    todo = [
        Target(k, j * block_tokens, block_tokens)
        for (k, j), e in zip(keys, exists, strict=True)
        if not e
    ]
    placed = 0
    for batch in _batches(todo, kv.pool.shape.page_bytes // kv.pool.page_tokens):
        items = await asyncio.to_thread(_objects, kv, batch)
        refused = await store.put_many(items, preferred_segment=segment, owner=namespace)
        placed += sum(r is None for r in refused)
    return placed


def _objects(kv: PagedKV, targets: Sequence[Target]) -> list[tuple[str, bytes]]:
    return [(t.key, block_object(kv, t.start, t.tokens)) for t in targets]


async def remove_tail(store: StoreClient, request_id: str, tail_key: str | None) -> None:
    """The request's partial tail block belongs to it alone: gone when the request ends
    (best effort: an unpinned object left behind ages out of the pool)."""
    if tail_key:
        try:
            await store.remove_many([tail_key], force=True)
        except Exception as exc:
            log.debug("%s: tail not removed: %s", request_id, exc)

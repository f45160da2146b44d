"""A decode request's KV in the engine's pool: shared, loaded, or computed again.

A decode instance gets a prompt's KV from three places, cheapest first:
1. the engine's own pool: leading prompt blocks it still caches (an earlier request with the
   same prefix, or this request before it was preempted) are shared, no bytes move
   (`start`, which also says how many pages the request still needs);
2. the store: the rest of the whole blocks under their chained keys, read layer by layer
   straight into the request's pages, then the request's partial tail object (`load`);
3. a local prefill: whatever the store cannot give (an evicted block, a lost node), and the
   output tokens a preempted request had generated (`compute`).

The pages are reserved before anything is written (admission by pages, core.kv_admission),
so loading never allocates; what is loaded is published to the pool's cache once whole.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import torch

from mooncake.engine import Engine, EngineError, PagedKV
from mooncake.serving.kvstore import PrefixLoader, PrefixLoadError, leading_hits
from mooncake.store.client import StoreClient
from mooncake.work import DecodeWork

log = logging.getLogger("mooncake.decode.kv")


class Missing(Exception):
    """Some of the prompt's KV objects are not in the store (evicted, a node lost)."""


@dataclass
class PromptKV:
    """A request's sequence in the pool and where its KV stands."""

    kv: PagedKV
    shared_blocks: int  # leading prompt blocks shared from the pool's cache
    loaded_tokens: int = 0  # KV tokens that came from the pool or the store
    missing: str | None = None  # why the store could not give the rest (it is computed)

    @property
    def held_pages(self) -> int:
        return len(self.kv.pages)


def start(engine: Engine, work: DecodeWork) -> PromptKV:
    """A new sequence led by the prompt's blocks the pool caches (held, not copied)."""
    kv = engine.new_kv()
    shared = kv.adopt_cached(work.kv_keys)
    kv.length = shared * engine.block_tokens
    return PromptKV(kv, shared, loaded_tokens=kv.length)


def context_tokens(work: DecodeWork, output: list[int]) -> int:
    """KV tokens a request holds when it (re)joins: the prompt, and every output token
    but the last (whose KV the next step writes)."""
    return len(work.token_ids) + max(len(output) - 1, 0)


async def load(engine: Engine, store: StoreClient, work: DecodeWork, p: PromptKV) -> None:
    """Read the prompt's KV past the shared blocks from the store into `p.kv`'s (reserved)
    pages. Sets `p.missing` when the work names no KV or the store cannot give all of it
    (then `compute` makes it)."""
    bt, prompt = engine.block_tokens, len(work.token_ids)
    tail = work.tail_tokens if work.tail_key else 0
    if len(work.kv_keys) * bt + tail != prompt:
        p.missing = "no_kv"  # the work names no (or not all) KV: compute it here
        return
    try:
        await _load_blocks(engine, store, work, p)
        if tail and p.kv.length < prompt:
            await _load_tail(engine, store, work, p, tail)
    except Missing as exc:
        p.missing = "miss"
        log.info("%s: %s", work.request_id, exc)
    except PrefixLoadError as exc:
        p.missing = "bad_object"
        log.warning("%s: prompt KV from the store unusable (%s)", work.request_id, exc)
    except Exception as exc:  # the master did not answer, a transport failed, ...
        p.missing = "store_error"
        log.warning("%s: KV read failed (%s)", work.request_id, exc)


async def _load_blocks(engine: Engine, store: StoreClient, work: DecodeWork, p: PromptKV) -> None:
    keys = work.kv_keys[p.shared_blocks :]
    if not keys:
        return
    handle = await store.start_get(keys)
    size = engine.layout.object_size(engine.block_tokens)
    if leading_hits([handle.size(k) for k in keys], size) < len(keys):
        raise Missing("not all of the prompt's blocks are in the store")
    loader = PrefixLoader(handle, keys, engine.layout, engine.block_tokens, p.kv,
                          first=p.shared_blocks)  # fmt: skip
    await loader.fill()
    p.kv.length = len(work.kv_keys) * engine.block_tokens
    p.loaded_tokens = p.kv.length


async def _load_tail(
    engine: Engine, store: StoreClient, work: DecodeWork, p: PromptKV, tail: int
) -> None:
    assert work.tail_key is not None
    raw = torch.empty(engine.layout.object_size(tail), dtype=torch.uint8)
    sizes = await store.get_many_into([work.tail_key], [raw])
    if sizes[0] != raw.numel():
        raise Missing("the prompt's tail is not in the store")
    try:
        payload = engine.layout.payload(raw, tail)
    except EngineError as exc:
        raise PrefixLoadError(str(exc)) from exc
    start_at = p.kv.length
    await asyncio.to_thread(_write_tail, p.kv, start_at, payload)
    p.kv.length = start_at + tail
    p.loaded_tokens = p.kv.length


def _write_tail(kv: PagedKV, start_at: int, payload: torch.Tensor) -> None:
    for layer in range(payload.shape[0]):
        kv.load_layer(layer, start_at, payload[layer])


def compute(engine: Engine, work: DecodeWork, p: PromptKV, output: list[int]) -> int:
    """Compute (compute thread) the KV `p.kv` lacks: the prompt's past what was loaded, and
    the output tokens but the last. Returns the tokens computed. Publishes the prompt's whole
    blocks to the pool's cache."""
    prompt = list(work.token_ids)
    tokens = prompt + output[:-1]
    before = p.kv.length
    if p.kv.length < len(tokens):
        engine.prefill(tokens, prefix=p.kv)  # writes positions kv.length.. into its pages
    p.kv.length = len(tokens)
    p.kv.publish_blocks(work.kv_keys, engine.block_tokens)
    return len(tokens) - before

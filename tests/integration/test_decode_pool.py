"""The decode worker on a bounded KV pool, over a real NATS and store (the rig of
test_decode_worker, with a pool far smaller than the work): admission by pages, preemption
instead of failure, work left waiting on its queue, prompt blocks shared from the pool."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest_asyncio
from test_decode_worker import BLOCK, Rig, rig_settings, running_rig, tokens

from mooncake import events as ev
from mooncake.config import DummyModel, EngineSettings
from mooncake.model_info import dummy_spec

CONTEXT = 512
# The smallest pool the engine accepts: one full context plus two blocks (34 pages of 16
# tokens for the dummy model's 512 bytes of KV per token).
PAGES = (CONTEXT + 2 * BLOCK) // 16


@pytest_asyncio.fixture
async def tight(nats_url: str, namespace: str, tmp_path: Path) -> AsyncIterator[Rig]:
    engine = EngineSettings(model="dummy", threads=1, max_batch=8,
                            dummy=DummyModel(context=CONTEXT))  # fmt: skip
    per_token = dummy_spec(engine).kv_bytes_per_token(4)
    budget = PAGES * 16 * per_token
    settings = rig_settings(nats_url, namespace, tmp_path, engine=engine, kv_cache_bytes=budget)
    async with running_rig(settings) as r:
        assert r.worker.engine.pool.pages.total == PAGES
        yield r


async def test_a_working_set_over_the_pool_is_preempted_never_failed(tight: Rig) -> None:
    """Five requests whose KV together is ~2.5x the pool: the youngest are preempted and
    resumed, every request streams exactly the tokens it gets alone, the record has each
    preemption and resumption, and every page goes back."""
    r = tight
    r.batch.delay_s = 0.005
    shapes = [(60, 150), (75, 140), (90, 130), (100, 120), (45, 160)]
    works = [await r.prepare(f"p-{i}", tokens(n, 40 + i), m) for i, (n, m) in enumerate(shapes)]
    for w in works:
        await r.send(w)
    for w, (_, m) in zip(works, shapes, strict=True):
        final = await r.wait_final(w.request_id, within=60)
        assert final.finish_reason == "length" and final.index == m, final
        assert r.streamed(w) == r.expected(list(w.token_ids), m), w.request_id
        (done,) = r.of(ev.RequestCompleted, w.request_id)
        assert isinstance(done, ev.RequestCompleted) and done.output_tokens == m
        assert not r.of(ev.RequestFailed, w.request_id)
    await r.idle()
    preempted = [e for w in works for e in r.of(ev.DecodePreempted, w.request_id)]
    resumed = [e for w in works for e in r.of(ev.DecodeResumed, w.request_id)]
    assert preempted, "the pool never ran out: the test does not exercise preemption"
    assert len(resumed) == len(preempted) == r.worker.loop.preemptions
    for e in resumed:
        assert isinstance(e, ev.DecodeResumed)
        assert e.reloaded_tokens + e.recomputed_tokens > 0 and e.waited_s > 0
    assert r.worker.recomputed == 0  # the prompts' KV came back from the pool or the store
    assert r.worker.engine.pool.pages.used == 0
    assert max(r.batch.sizes) >= 2


async def test_work_that_cannot_get_pages_waits_on_its_queue(tight: Rig) -> None:
    """While a request waits for pages the worker pulls no more work: the rest stays on the
    queue (pending in the stream), and all of it runs once pages come free."""
    r = tight
    r.batch.delay_s = 0.02
    works = [await r.prepare(f"q-{i}", tokens(300, 60 + i), 100) for i in range(4)]
    for w in works:
        await r.send(w)
    spec = r.worker._consumer.spec
    seen_pending = 0
    for _ in range(40):
        info = await r.js.consumer_info(spec.stream, spec.durable)
        if info.num_pending:
            seen_pending = max(seen_pending, info.num_pending)
            assert len(r.worker.jobs) <= 2  # one running, at most one waiting for pages
        if r.final(works[0].request_id) is not None:
            break
        await asyncio.sleep(0.05)
    assert seen_pending >= 1, "all work was pulled although the pool holds one request"
    for w in works:
        final = await r.wait_final(w.request_id, within=60)
        assert final.finish_reason == "length" and final.index == 100
        assert r.streamed(w) == r.expected(list(w.token_ids), 100)
    await r.idle()


async def test_prompt_blocks_are_shared_from_the_pool(tight: Rig) -> None:
    """A second request with the same prompt blocks takes them from the worker's own pool:
    it decodes the same tokens after the store lost them, without recomputing anything."""
    r = tight
    prompt = tokens(4 * BLOCK + 5, 77)
    a = await r.prepare("s-a", prompt, 20)
    await r.send(a)
    await r.wait_final("s-a")
    await r.idle()
    pool = r.worker.engine.pool
    assert all(pool.pages.contains(k) for k in a.kv_keys)
    await r.store.remove_many(list(a.kv_keys), force=True)
    assert not any(await r.store.exists_many(list(a.kv_keys)))
    b = await r.prepare("s-b", prompt, 20, store_blocks=False)  # the tail only
    await r.send(b)
    final = await r.wait_final("s-b")
    assert final.index == 20 and r.streamed(b) == r.expected(prompt, 20)
    assert r.worker.recomputed == 0
    await r.idle()

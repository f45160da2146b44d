"""An engine pool's cached blocks reach the Conductor's engine-tier index over a real NATS:
announced as they are cached and evicted, a lost batch healed by a snapshot, and the store's
own index untouched."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import nats

from mooncake.core.block_index import BlockIndex
from mooncake.engine.pages import PageAllocator
from mooncake.namespace import Namespace
from mooncake.serving.engine_tier import EngineTier
from mooncake.store.kv_follow import KvIndexSubscriber
from mooncake.store.kv_index import KvIndexFollower


async def until(check: Callable[[], bool], what: str, within_s: float = 5.0) -> None:
    for _ in range(int(within_s / 0.02)):
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def cache(pages: PageAllocator, key: str) -> None:
    """A block of 2 pages published, then released by its sequence: cached, idle."""
    got = pages.alloc(2)
    assert got is not None and pages.publish(key, got)
    pages.release(got)


async def test_engine_blocks_are_followed_and_a_lost_batch_is_healed(
    nats_url: str, namespace: str
) -> None:
    ns = Namespace(namespace)
    worker, conductor = await nats.connect(nats_url), await nats.connect(nats_url)
    engine_index, store_index = BlockIndex(), BlockIndex()
    follower = KvIndexFollower(engine_index)
    sub = KvIndexSubscriber(conductor, ns, follower, engine=True)
    store_sub = KvIndexSubscriber(conductor, ns, KvIndexFollower(store_index))
    await sub.start()
    await store_sub.start()
    pages = PageAllocator(6)
    tier = EngineTier(worker, ns, "prefill-0", pages, every_s=3600)  # announced by hand
    runner = asyncio.create_task(tier.run())
    try:
        await asyncio.sleep(0.1)  # its snapshot subscription is up
        cache(pages, "a")
        cache(pages, "b")
        assert await tier.announce()
        await until(lambda: engine_index.holders("b") == {"prefill-0"}, "a and b followed")
        assert not await tier.announce()  # nothing changed: nothing sent
        # A batch lost on the way: the next one shows the gap, the snapshot heals it.
        cache(pages, "c")
        tier.log.record(["c"], [])  # as if published, but never sent
        assert pages.alloc(4) is not None  # evicts a and b (least recently used)
        assert await tier.announce()
        await until(lambda: sub.snapshots == 1, "a snapshot after the gap")
        await until(lambda: engine_index.holders("c") == {"prefill-0"}, "c from the snapshot")
        assert not engine_index.holders("a") and not engine_index.holders("b")
        assert len(store_index) == 0  # the store's own index never sees an engine tier
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        await sub.stop()
        await store_sub.stop()
        await worker.close()
        await conductor.close()

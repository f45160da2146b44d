"""An engine's KV pool announced to the Conductor's index: that instance's engine tier.

The prompt blocks a worker's pool caches (`engine.pages`: published after a prefill or a
decode load, kept until evicted) are hits that need no transfer at all, not even from the
instance's own DRAM segment. Every `every_s` the worker compares the pool's cached keys with
what it announced last and publishes the difference as a KV event batch on
`mc.kv.engine.<instance>` (core NATS, sequence-numbered per instance, an epoch per process
life: the same protocol as the store nodes' `mc.kv.events.<node>`, `store.kv_index`), and
answers `mc.kv.engine.<instance>.snapshot` with the whole set, so the Conductor recovers a
lost batch. The Conductor keeps these in their own index (`ClusterView.engine_blocks`): they
are local to one instance, and no other instance can fetch them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from mooncake.engine.pages import PageAllocator
from mooncake.namespace import Namespace
from mooncake.store import protocol as p
from mooncake.store.kv_follow import answer_snapshot, batch_bytes, tip_bytes
from mooncake.store.kv_index import KvEventLog

log = logging.getLogger("mooncake.engine_tier")

ANNOUNCE_EVERY_S = 0.25


class EngineTier:
    def __init__(
        self,
        nc: NATS,
        ns: Namespace,
        instance: str,
        pages: PageAllocator,
        every_s: float = ANNOUNCE_EVERY_S,
    ) -> None:
        self.nc, self.pages, self.every_s = nc, pages, every_s
        self.subjects = p.Subjects(ns)
        self.instance = instance
        self.log = KvEventLog(instance, epoch=uuid.uuid4().hex[:16])
        self._sub: Subscription | None = None

    async def run(self) -> None:
        """Answer snapshot requests and announce changes until cancelled."""
        subject = self.subjects.engine_kv_snapshot(self.instance)
        self._sub = await self.nc.subscribe(subject, cb=self._on_snapshot)
        try:
            while True:
                await self.announce()
                await asyncio.sleep(self.every_s)
        finally:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    async def announce(self) -> bool:
        """Publish what changed since the last announcement; True if anything did."""
        now = set(self.pages.cached_keys())
        known = self.log.keys
        stored, removed = sorted(now - known), sorted(known - now)
        subject = self.subjects.engine_kv_events(self.instance)
        if not stored and not removed:  # where it stands, so a lost last batch is seen
            with contextlib.suppress(Exception):
                await self.nc.publish(subject, tip_bytes(self.log))
            return False
        batch = self.log.record(stored, removed)
        with contextlib.suppress(Exception):  # a lost batch is a gap: the snapshot heals it
            await self.nc.publish(subject, batch_bytes(batch))
        return True

    async def _on_snapshot(self, msg: Msg) -> None:
        await answer_snapshot(self.log, msg)

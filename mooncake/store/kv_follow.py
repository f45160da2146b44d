"""Follow every node's KV index events (`mc.kv.events.<node>`, core NATS) into a BlockIndex.

Core NATS may drop a message (a slow consumer, a reconnect): the per-node sequence numbers
reveal the gap and the follower then fetches that node's snapshot
(`mc.kv.snapshot.<node>`, request/reply) and carries on from it. The Conductor owns one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from mooncake.aio import cancel_all
from mooncake.namespace import Namespace
from mooncake.store import protocol as p
from mooncake.store.kv_index import (
    Applied,
    IndexState,
    KvEventBatch,
    KvEventLog,
    KvIndexFollower,
    KvSnapshot,
    KvTip,
    NeedSnapshot,
)

log = logging.getLogger("mooncake.store.kv_follow")

# Producers tip every TIP_EVERY_S (a store node on a timer of its own, an engine tier at
# each idle announcement, as often): one not heard of for SILENT_S is dead or cut off, and
# its blocks unknown.
TIP_EVERY_S = 0.25  # a lost last batch is seen within this (a message per node each time)
SILENT_S = 3.0


class KvIndexSubscriber:
    """Follows the store nodes' KV events (`mc.kv.events.*`), or with `engine=True` the
    engines' pools (`mc.kv.engine.*`, each instance's engine tier)."""

    def __init__(
        self,
        nc: NATS,
        ns: Namespace,
        follower: KvIndexFollower,
        *,
        timeout_s: float = 2.0,
        engine: bool = False,
        on_state: Callable[[], None] | None = None,
        silent_s: float = SILENT_S,
    ) -> None:
        self.nc, self.follower, self.timeout_s = nc, follower, timeout_s
        self.silent_s = silent_s  # a node not heard of for this long is DEGRADED
        self._on_state = on_state  # called after a node's index state changed
        # node -> (its index state, since when: wall-clock seconds)
        self.states: dict[str, tuple[IndexState, float]] = {}
        self.subjects = p.Subjects(ns)
        self._events = self.subjects.engine_kv_events() if engine else self.subjects.kv_events()
        self._snapshot = self.subjects.engine_kv_snapshot if engine else self.subjects.kv_snapshot
        self.snapshots = 0
        self._sub: Subscription | None = None
        self._fetching: set[str] = set()
        # node -> how many times it was dropped: a snapshot fetched across a drop is stale
        self._drops: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(self._events, cb=self._on_events)
        await self.nc.flush()
        task = asyncio.get_running_loop().create_task(self._watch_silence())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _watch_silence(self) -> None:
        while True:
            await asyncio.sleep(self.silent_s / 4)
            for node_id in self.follower.silence(time.monotonic(), self.silent_s):
                log.warning("KV index of %s: silent for %.1f s", node_id, self.silent_s)
                self._changed(node_id)

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
        await cancel_all(list(self._tasks))  # a snapshot retry loop may swallow one cancel

    def drop_node(self, node_id: str) -> None:
        """The node is gone: its blocks leave the index and its state is no longer known
        (its next life starts again from a snapshot, and a new `since`)."""
        self.follower.drop_node(node_id)
        self.states.pop(node_id, None)
        self._drops[node_id] = self._drops.get(node_id, 0) + 1

    async def _on_events(self, msg: Msg) -> None:
        try:
            w = p.KvEvents.model_validate_json(msg.data)
        except Exception:
            log.warning("unreadable KV events on %s ignored", msg.subject)
            return
        res: Applied | NeedSnapshot
        if w.tip:
            res = self.follower.tip(KvTip(w.node_id, w.seq, w.epoch))
        else:
            batch = KvEventBatch(
                w.node_id, w.seq, tuple(w.stored), tuple(w.removed), w.epoch, tuple(w.ssd),
                tuple(w.dram),
            )  # fmt: skip
            res = self.follower.apply(batch)
        self.follower.heard(w.node_id, time.monotonic())
        self._changed(w.node_id)
        if isinstance(res, NeedSnapshot) and w.node_id not in self._fetching:
            self._fetching.add(w.node_id)
            task = asyncio.get_running_loop().create_task(self._fetch(w.node_id))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _changed(self, node_id: str) -> None:
        state = self.follower.state(node_id)
        known = self.states.get(node_id)
        if known is not None and known[0] is state:
            return
        self.states[node_id] = (state, time.time())
        if known is not None or state is not IndexState.EXACT:
            log.info("KV index of %s: %s", node_id, state.value)
        if self._on_state is not None:
            self._on_state()

    async def _fetch(self, node_id: str) -> None:
        drops = self._drops.get(node_id, 0)
        try:
            delay = 0.05
            for _ in range(8):
                try:
                    resp = await self.nc.request(
                        self._snapshot(node_id), b"", timeout=self.timeout_s
                    )
                    if self._drops.get(node_id, 0) != drops:
                        return  # dropped meanwhile (a dead node): no ghost of it comes back
                    w = p.KvSnapshotWire.model_validate_json(resp.data)
                    snap = KvSnapshot(w.node_id, w.seq, tuple(w.keys), w.epoch, tuple(w.ssd))
                    res = self.follower.load_snapshot(snap)
                    self.follower.heard(w.node_id, time.monotonic())
                    self.snapshots += 1
                    if not isinstance(res, NeedSnapshot):
                        return
                    # Batches buffered behind it still have a hole: take a newer snapshot.
                except Exception as e:
                    log.info("snapshot of %s failed (%s); retrying", node_id, type(e).__name__)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, 1.0)
            if self._drops.get(node_id, 0) == drops:
                self.follower.degrade(node_id)
                log.warning("no usable snapshot from %s: its blocks count as unknown", node_id)
        finally:
            self._fetching.discard(node_id)
            if self._drops.get(node_id, 0) == drops:  # not dropped meanwhile (a dead node)
                self._changed(node_id)


# --- the producer side's wire form (store nodes, engine tiers) ------------------------------


def batch_bytes(batch: KvEventBatch) -> bytes:
    """A producer's KV event batch as `KvIndexSubscriber` reads it."""
    wire = p.KvEvents(
        node_id=batch.node_id, seq=batch.seq, epoch=batch.epoch,
        stored=list(batch.stored), removed=list(batch.removed), ssd=list(batch.ssd),
        dram=list(batch.dram),
    )  # fmt: skip
    return wire.model_dump_json().encode()


def tip_bytes(log: KvEventLog) -> bytes:
    """A producer's tip (its epoch and last seq, no changes) as `KvIndexSubscriber` reads
    it. Also before its first batch (seq 0): a restarted producer that holds nothing yet
    still tells the followers its old life's keys are gone."""
    tip = log.tip()
    wire = p.KvEvents(node_id=tip.node_id, seq=tip.seq, epoch=tip.epoch, tip=True)
    return wire.model_dump_json().encode()


async def answer_snapshot(log: KvEventLog, msg: Msg) -> None:
    """Reply to a follower's snapshot request with the producer's whole key set."""
    snap = log.snapshot()
    wire = p.KvSnapshotWire(
        node_id=snap.node_id, seq=snap.seq, epoch=snap.epoch, keys=sorted(snap.keys),
        ssd=sorted(snap.ssd),
    )  # fmt: skip
    if msg.reply:
        with contextlib.suppress(Exception):
            await msg.respond(wire.model_dump_json().encode())

"""The store master service keeps its memory bounded: the journal while JetStream does not
take it (`journal_max`, the oldest dropped), the per-node change sequences (pruned with the
node, never made by a read), and the figures `memory_parts` states. The object count limit is
pure state: `test_master_state`."""

from __future__ import annotations

import asyncio
import logging
import random
import tracemalloc
from collections.abc import Sequence

import pytest

from mooncake import events as ev
from mooncake.config import StoreSettings
from mooncake.store import master_state as ms
from mooncake.store import protocol as p
from mooncake.store.master import (
    MASTER_BYTES_PER_EXTRA_REPLICA,
    MASTER_BYTES_PER_JOURNAL_ENTRY,
    MASTER_BYTES_PER_JOURNAL_REPLICA,
    MASTER_BYTES_PER_OBJECT,
    StoreMaster,
    _journal_replica,
    memory_parts,
    new_state,
)
from mooncake.store.types import Tier

MiB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FlakyPublisher:
    """Refuses every batch while `down`; while `gate` is set, a batch waits for it to open."""

    def __init__(self) -> None:
        self.down = True
        self.gate: asyncio.Event | None = None
        self.published: list[str] = []

    async def publish_many_barrier(self, events: Sequence[ev.Event]) -> None:
        if self.gate is not None:
            await self.gate.wait()
        if self.down:
            raise ConnectionError("JetStream unreachable")
        self.published += [_key(e) for e in events]


def _key(e: ev.Event) -> str:
    assert isinstance(e, ev.KvObjectStored | ev.KvObjectRemoved)
    return e.key


def _master(
    publisher: FlakyPublisher | None = None, journal_max: int = 100_000, clock: Clock | None = None
) -> StoreMaster:
    state = new_state(StoreSettings(high_watermark=1.0, node_timeout_s=10.0), seed=1)
    return StoreMaster(
        None,  # type: ignore[arg-type]  # nothing here talks to NATS (notifications fail quietly)
        ev.Namespace("mc"),
        state,
        publisher=publisher,  # type: ignore[arg-type]
        journal_max=journal_max,
        clock=clock or Clock(),
    )


def _mount(m: StoreMaster, node: str) -> None:
    seg = p.SegmentWire(segment_id=f"{node}:0", node_id=node, tier=Tier.DRAM, size=8 * MiB)
    req = p.MountRequest(node_id=node, segments=[seg])
    assert not m._mount(req.model_dump_json().encode()).refused


def _store(m: StoreMaster, *keys: str, node: str = "n1") -> None:
    for key in keys:
        now = m.clock()
        plan = m.state.put_start(key, 100, now, preferred_segment=f"{node}:0")
        assert isinstance(plan, ms.PutPlan), plan
        assert m.state.put_end(key, now) is ms.OK
    m._dispatch_changes()


def _journaled(m: StoreMaster) -> list[str]:
    return [_key(e) for e in m._journal]


# --- the journal ------------------------------------------------------------------------------


async def test_the_journal_keeps_the_newest_journal_max_events_while_sends_fail(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pub = FlakyPublisher()
    m = _master(pub, journal_max=5)
    _mount(m, "n1")
    keys = [f"k{i:02d}" for i in range(12)]
    with caplog.at_level(logging.WARNING, "mooncake.store.master"):
        for i in range(0, len(keys), 3):
            _store(m, *keys[i : i + 3])
            assert len(m._journal) <= 5
            await m._flush_journal()  # fails: nothing leaves, nothing is re-queued twice
            assert len(m._journal) <= 5
        assert _journaled(m) == keys[-5:]  # the oldest went
        full = [r for r in caplog.records if "journal full" in r.getMessage()]
        assert len(full) == 1  # once for the outage, not once an event
        pub.down = False
        await m._flush_journal()
    assert pub.published == keys[-5:] and not m._journal
    resumed = [r for r in caplog.records if "dropped meanwhile" in r.getMessage()]
    assert len(resumed) == 1 and "7 event(s)" in resumed[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.WARNING, "mooncake.store.master"):  # a new outage: warned again
        pub.down = True
        _store(m, *[f"j{i}" for i in range(6)])
    assert len([r for r in caplog.records if "journal full" in r.getMessage()]) == 1


async def test_events_dropped_while_a_chunk_is_in_flight_are_not_popped_twice() -> None:
    pub = FlakyPublisher()
    pub.down, pub.gate = False, asyncio.Event()
    m = _master(pub, journal_max=4)
    _mount(m, "n1")
    _store(m, "a", "b", "c", "d")
    flush = asyncio.create_task(m._flush_journal())
    await asyncio.sleep(0.01)  # the chunk a..d is out, unacknowledged
    _store(m, "e", "f")  # the journal is full: a and b (the chunk's head) are dropped
    assert _journaled(m) == ["c", "d", "e", "f"]
    pub.gate.set()
    await flush
    assert pub.published == ["a", "b", "c", "d", "e", "f"] and not m._journal


# --- per-node change sequences ----------------------------------------------------------------


async def test_a_lost_nodes_sequence_goes_with_it_and_a_read_adds_none() -> None:
    clock = Clock()
    m = _master(clock=clock)
    _mount(m, "n1")
    _mount(m, "n2")
    _store(m, "x", node="n1")
    _store(m, "y", node="n2")
    assert m._node_seq == {"n1": 1, "n2": 1}

    listing = m._node_objects(p.NodeObjectsRequest(node_id="ghost").model_dump_json().encode())
    assert listing.seq == 0 and listing.objects == []
    assert "ghost" not in m._node_seq

    clock.now = 15.0
    m._heartbeat(p.HeartbeatRequest(node_id="n2").model_dump_json().encode())
    m._tick()  # n1: silent for 15 s, lost (and its object with it)
    assert m.state.nodes() == ["n2"]
    assert m._node_seq == {"n2": 1}
    _mount(m, "n1")  # back: its sequence starts again
    assert m._node_seq == {"n1": 0, "n2": 1}


# --- the stated bound -------------------------------------------------------------------------


def test_memory_parts_are_the_limits_times_the_measured_bytes() -> None:
    s = StoreSettings(max_objects=1000, journal_max=200)
    assert memory_parts(s) == {
        "objects": 1000 * MASTER_BYTES_PER_OBJECT,
        "journal": 200 * MASTER_BYTES_PER_JOURNAL_ENTRY,
    }
    two = memory_parts(StoreSettings(max_objects=1000, journal_max=200, replicas=2))
    assert two == {
        "objects": 1000 * (MASTER_BYTES_PER_OBJECT + MASTER_BYTES_PER_EXTRA_REPLICA),
        "journal": 200 * (MASTER_BYTES_PER_JOURNAL_ENTRY + MASTER_BYTES_PER_JOURNAL_REPLICA),
    }


def test_the_stated_bytes_cover_what_a_full_churned_table_and_journal_take() -> None:
    """The figures `memory_parts` multiplies, re-measured small: a table at `max_objects`
    churned by as many puts again (each evicting one), and a journal of stored events."""
    n = 2048
    state = new_state(StoreSettings(high_watermark=1.0, max_objects=n), seed=1)
    m = StoreMaster(None, ev.Namespace("mc"), state, journal_max=n)  # type: ignore[arg-type]
    _mount(m, "n1")
    rng = random.Random(0)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(2 * n // 64):
            keys = [f"{rng.getrandbits(128):032x}" for _ in range(64)]
            items = [
                p.PutItem(key=k, size=rng.choice((64, 100, 4096)), owner="tenant:a") for k in keys
            ]
            m._put_start(p.PutStartRequest(items=items).model_dump_json().encode())
            m._put_end(p.KeysRequest(keys=keys).model_dump_json().encode())
            m.state.drain()
        table = tracemalloc.get_traced_memory()[0] - base
        replica = next(iter(m.state.node_objects("n1")))[1]
        for _ in range(n):  # built as `_dispatch_changes` does (the same fields set), own keys
            m._journal_add(ev.KvObjectStored(
                event_id=m._next_event_id(), occurred_at=ev.utcnow(),
                key=f"{rng.getrandbits(128):032x}", size_bytes=replica.size,
                replicas=[_journal_replica(replica)], pin="none",
            ))  # fmt: skip
        journal = tracemalloc.get_traced_memory()[0] - base - table
    finally:
        tracemalloc.stop()
    assert len(m.state) == n and len(m._journal) == n
    assert table / n <= MASTER_BYTES_PER_OBJECT
    assert journal / n <= MASTER_BYTES_PER_JOURNAL_ENTRY

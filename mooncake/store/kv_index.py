"""KV index events: which blocks each node holds, sequenced per node (`mc.kv.events.<node>`).

Producer (a node): `KvEventLog` numbers its batches 1, 2, 3 ... and keeps its current key set,
so it can answer a snapshot request at any time.

Consumer (the Conductor's `BlockIndex`): `KvIndexFollower` applies each node's batches in
sequence order. The events ride core NATS (no durability, by design: DESIGN.md "The event
flow"), so batches can be lost, duplicated or reordered. A duplicate or old batch is ignored; a
gap makes the follower ask for a snapshot (once per gap) and buffer that node's later batches;
the snapshot replaces the node's keys and the buffered batches newer than it are then applied.
If the missing batch turns up before the snapshot (a reorder), the gap closes by itself and a
snapshot arriving later that is older than the applied state is ignored.

Within one batch `stored` is applied before `removed` (producer and consumer agree on this, so a
key stored and removed in the same interval ends absent on both sides).

Tiers: a node holds a key in DRAM or only on its SSD. `ssd` lists keys whose fastest copy on
the node is now on SSD (an offload on eviction, or a key stored straight to SSD), `dram` keys
back in DRAM (a promotion on a hit); a key the node no longer holds at all is `removed` (an
eviction with nowhere to offload, a delete). The order within a batch is stored, ssd, dram,
removed. The Conductor charges a block held only on SSD the SSD read (core/conductor.py).

A lost batch is seen only when a later one arrives; so that a lost *last* batch (a node that
then goes quiet) is seen too, producers publish their tip (`KvTip`: epoch and last seq) every
second or so, and a tip ahead of what the follower applied is a gap like any other.

`epoch` (default "") tells two lives of a producer apart: a node that restarts begins again at
seq 1, which would otherwise look like a stale duplicate. A new epoch resets that node.

Each node's index is in one state (`IndexState`): EXACT while its batches follow on; RESYNCING
from a gap until its snapshot (or the missing batch) closes it; DEGRADED when no snapshot could
be had (`degrade`), until one is, or when the node fell silent (no batch, tip or snapshot for
`silence`'s window: killed, cut off), until it is heard again. A node not EXACT is `unsure`:
the Conductor then counts its blocks as unknown, not as hits (`BlockIndex.match(exclude=...)`),
so no decision assumes a block the index may have missed the removal of.

PURE: no I/O, no clocks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

from mooncake.core.block_index import BlockIndex

MAX_BUFFERED = 4096  # per node, while waiting for a snapshot; beyond it the oldest are dropped


class IndexState(StrEnum):
    EXACT = "exact"
    RESYNCING = "resyncing"
    DEGRADED = "degraded"


@dataclass(frozen=True, slots=True)
class KvEventBatch:
    node_id: str
    seq: int  # 1, 2, 3 ... per node (per epoch)
    stored: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    epoch: str = ""
    ssd: tuple[str, ...] = ()  # now held on this node only on SSD (offloaded)
    dram: tuple[str, ...] = ()  # back in this node's DRAM (promoted)


@dataclass(frozen=True, slots=True)
class KvSnapshot:
    """The node's whole key set as of (after) batch `seq` (0: before any batch); `ssd`: those
    of `keys` it holds only on SSD."""

    node_id: str
    seq: int
    keys: tuple[str, ...]
    epoch: str = ""
    ssd: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class KvTip:
    """A producer's position without changes: its last batch so far is `seq`."""

    node_id: str
    seq: int
    epoch: str = ""


@dataclass(frozen=True, slots=True)
class Applied:
    node_id: str
    seq: int  # the last seq applied for the node (its expected seq - 1)
    applied: int  # batches applied by this call: 0 for a duplicate or a buffered batch


@dataclass(frozen=True, slots=True)
class NeedSnapshot:
    """Fetch `node_id`'s snapshot and pass it to `load_snapshot` (asked once per gap; see
    `KvIndexFollower.awaiting` to ask again after a lost request)."""

    node_id: str
    reason: Literal["gap", "buffer_gap", "tip"]


class KvEventLog:
    """The producer side: a node's sequenced batches and current key set."""

    def __init__(self, node_id: str, epoch: str = "") -> None:
        self.node_id = node_id
        self.epoch = epoch
        self.seq = 0
        self._keys: set[str] = set()
        self._ssd: set[str] = set()  # of `_keys`, those held only on SSD

    @property
    def keys(self) -> frozenset[str]:
        return frozenset(self._keys)

    @property
    def ssd_keys(self) -> frozenset[str]:
        return frozenset(self._ssd)

    def record(
        self,
        stored: Iterable[str] = (),
        removed: Iterable[str] = (),
        *,
        ssd: Iterable[str] = (),
        dram: Iterable[str] = (),
    ) -> KvEventBatch:
        """The next batch; applied in the order stored, ssd, dram, removed."""
        stored_t, removed_t, ssd_t, dram_t = tuple(stored), tuple(removed), tuple(ssd), tuple(dram)
        self._keys.update(stored_t)
        self._ssd.update(k for k in ssd_t if k in self._keys)
        self._ssd.difference_update(dram_t)
        self._keys.difference_update(removed_t)
        self._ssd.difference_update(removed_t)
        self.seq += 1
        return KvEventBatch(self.node_id, self.seq, stored_t, removed_t, self.epoch, ssd_t, dram_t)

    def tip(self) -> KvTip:
        return KvTip(self.node_id, self.seq, self.epoch)

    def snapshot(self) -> KvSnapshot:
        return KvSnapshot(
            self.node_id, self.seq, tuple(sorted(self._keys)), self.epoch, tuple(sorted(self._ssd))
        )


@dataclass(slots=True)
class _Stream:
    epoch: str
    expected: int = 1
    awaiting: bool = False
    degraded: bool = False  # no snapshot could be had for the gap it awaits
    heard: float | None = None  # when it was last heard of (`heard`); None: not timed
    silent: bool = False  # not heard of for longer than `silence`'s window
    buffer: dict[int, KvEventBatch] = field(default_factory=dict)


class KvIndexFollower:
    """Feeds one `BlockIndex` from every node's KV event stream."""

    def __init__(self, index: BlockIndex) -> None:
        self.index = index
        self._streams: dict[str, _Stream] = {}
        self.stats: dict[str, int] = dict.fromkeys(
            ("applied", "duplicates", "gaps", "snapshots", "buffer_dropped"), 0
        )

    def awaiting(self) -> list[str]:
        """Nodes whose snapshot is still awaited."""
        return sorted(n for n, s in self._streams.items() if s.awaiting)

    def state(self, node_id: str) -> IndexState:
        """A node never heard of is EXACT: it holds nothing the index says it holds."""
        s = self._streams.get(node_id)
        if s is None:
            return IndexState.EXACT
        if s.silent or (s.awaiting and s.degraded):
            return IndexState.DEGRADED
        return IndexState.RESYNCING if s.awaiting else IndexState.EXACT

    def states(self) -> dict[str, IndexState]:
        return {n: self.state(n) for n in sorted(self._streams)}

    def unsure(self) -> frozenset[str]:
        """Nodes whose blocks the index may have wrong (not EXACT)."""
        return frozenset(n for n, s in self._streams.items() if s.awaiting or s.silent)

    def heard(self, node_id: str, now: float) -> bool:
        """`node_id` was heard of at `now` (any batch, tip or snapshot); True when that ends
        its silence."""
        s = self._streams.get(node_id)
        if s is None:
            return False
        s.heard = now
        was, s.silent = s.silent, False
        return was

    def silence(self, now: float, after_s: float) -> list[str]:
        """Nodes not heard of for longer than `after_s` (they tip every second or so: dead
        or cut off) are DEGRADED until heard again; returns those newly silent."""
        out = []
        for n, s in self._streams.items():
            if not s.silent and s.heard is not None and now - s.heard > after_s:
                s.silent = True
                out.append(n)
        return sorted(out)

    def degrade(self, node_id: str) -> None:
        """No snapshot of a resyncing node could be had: DEGRADED until one is loaded (or
        its missing batch turns up)."""
        s = self._streams.get(node_id)
        if s is not None and s.awaiting:
            s.degraded = True

    def expected(self, node_id: str) -> int:
        s = self._streams.get(node_id)
        return 1 if s is None else s.expected

    def apply(self, batch: KvEventBatch) -> Applied | NeedSnapshot:
        s = self._stream(batch.node_id, batch.epoch)
        if batch.seq < s.expected:
            self.stats["duplicates"] += 1
            return Applied(batch.node_id, s.expected - 1, 0)
        if batch.seq == s.expected:
            self._apply(s, batch)
            n = 1 + self._drain(s)
            if not s.buffer:  # a reorder that healed itself: no snapshot needed any more
                s.awaiting = s.degraded = False
            return Applied(batch.node_id, s.expected - 1, n)
        self._buffer(s, batch)
        if s.awaiting:
            return Applied(batch.node_id, s.expected - 1, 0)
        s.awaiting = True
        self.stats["gaps"] += 1
        return NeedSnapshot(batch.node_id, "gap")

    def tip(self, tip: KvTip) -> Applied | NeedSnapshot:
        """The producer says its last batch is `tip.seq`: behind it, a batch was lost. A
        DEGRADED node (its snapshot could not be had) is asked again at each tip, so it
        does not stay unknown once the producer can answer."""
        s = self._stream(tip.node_id, tip.epoch)
        if s.awaiting and s.degraded:
            return NeedSnapshot(tip.node_id, "tip")
        if tip.seq < s.expected or s.awaiting:
            return Applied(tip.node_id, s.expected - 1, 0)
        s.awaiting = True
        self.stats["gaps"] += 1
        return NeedSnapshot(tip.node_id, "tip")

    def load_snapshot(self, snap: KvSnapshot) -> Applied | NeedSnapshot:
        s = self._stream(snap.node_id, snap.epoch)
        if not s.awaiting and snap.seq < s.expected - 1:
            return Applied(snap.node_id, s.expected - 1, 0)  # older than what we have
        self.index.drop_node(snap.node_id)
        self.index.add(snap.node_id, snap.keys)
        self.index.to_ssd(snap.node_id, snap.ssd)
        self.stats["snapshots"] += 1
        s.expected = snap.seq + 1
        s.awaiting = s.degraded = False
        n = self._drain(s)
        if s.buffer:  # batches newer than the snapshot but not contiguous with it
            s.awaiting = True
            self.stats["gaps"] += 1
            return NeedSnapshot(snap.node_id, "buffer_gap")
        return Applied(snap.node_id, s.expected - 1, n)

    def drop_node(self, node_id: str) -> int:
        """A dead node: forget its keys and its stream (its next life starts at seq 1)."""
        self._streams.pop(node_id, None)
        return self.index.drop_node(node_id)

    def _stream(self, node_id: str, epoch: str) -> _Stream:
        s = self._streams.get(node_id)
        if s is None:
            s = self._streams[node_id] = _Stream(epoch)
        elif s.epoch != epoch:  # the producer restarted: its old keys are gone with it
            self.index.drop_node(node_id)
            s = self._streams[node_id] = _Stream(epoch)
        return s

    def _apply(self, s: _Stream, batch: KvEventBatch) -> None:
        self.index.add(batch.node_id, batch.stored)
        self.index.to_ssd(batch.node_id, batch.ssd)
        self.index.to_dram(batch.node_id, batch.dram)
        self.index.remove(batch.node_id, batch.removed)
        s.expected = batch.seq + 1
        self.stats["applied"] += 1

    def _buffer(self, s: _Stream, batch: KvEventBatch) -> None:
        s.buffer[batch.seq] = batch
        if len(s.buffer) > MAX_BUFFERED:
            del s.buffer[min(s.buffer)]
            self.stats["buffer_dropped"] += 1

    def _drain(self, s: _Stream) -> int:
        """Apply buffered batches that now follow on; drop those already covered."""
        n = 0
        for seq in sorted(s.buffer):
            if seq < s.expected:
                del s.buffer[seq]
            elif seq == s.expected:
                self._apply(s, s.buffer.pop(seq))
                n += 1
            else:
                break
        return n

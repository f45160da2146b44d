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

`epoch` (default "") tells two lives of a producer apart: a node that restarts begins again at
seq 1, which would otherwise look like a stale duplicate. A new epoch resets that node.

Each node's index is in one state (`IndexState`): EXACT while its batches follow on; RESYNCING
from a gap until its snapshot (or the missing batch) closes it; DEGRADED when no snapshot could
be had (`degrade`), until one is. A node not EXACT is `unsure`: the Conductor then counts its
blocks as unknown, not as hits (`BlockIndex.match(exclude=...)`), so no decision assumes a
block the index may have missed the removal of.

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


@dataclass(frozen=True, slots=True)
class KvSnapshot:
    """The node's whole key set as of (after) batch `seq` (0: before any batch)."""

    node_id: str
    seq: int
    keys: tuple[str, ...]
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
    reason: Literal["gap", "buffer_gap"]


class KvEventLog:
    """The producer side: a node's sequenced batches and current key set."""

    def __init__(self, node_id: str, epoch: str = "") -> None:
        self.node_id = node_id
        self.epoch = epoch
        self.seq = 0
        self._keys: set[str] = set()

    @property
    def keys(self) -> frozenset[str]:
        return frozenset(self._keys)

    def record(self, stored: Iterable[str] = (), removed: Iterable[str] = ()) -> KvEventBatch:
        stored_t, removed_t = tuple(stored), tuple(removed)
        self._keys.update(stored_t)
        self._keys.difference_update(removed_t)
        self.seq += 1
        return KvEventBatch(self.node_id, self.seq, stored_t, removed_t, self.epoch)

    def snapshot(self) -> KvSnapshot:
        return KvSnapshot(self.node_id, self.seq, tuple(sorted(self._keys)), self.epoch)


@dataclass(slots=True)
class _Stream:
    epoch: str
    expected: int = 1
    awaiting: bool = False
    degraded: bool = False  # no snapshot could be had for the gap it awaits
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
        if s is None or not s.awaiting:
            return IndexState.EXACT
        return IndexState.DEGRADED if s.degraded else IndexState.RESYNCING

    def states(self) -> dict[str, IndexState]:
        return {n: self.state(n) for n in sorted(self._streams)}

    def unsure(self) -> frozenset[str]:
        """Nodes whose blocks the index may have wrong (not EXACT)."""
        return frozenset(n for n, s in self._streams.items() if s.awaiting)

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

    def load_snapshot(self, snap: KvSnapshot) -> Applied | NeedSnapshot:
        s = self._stream(snap.node_id, snap.epoch)
        if not s.awaiting and snap.seq < s.expected - 1:
            return Applied(snap.node_id, s.expected - 1, 0)  # older than what we have
        self.index.drop_node(snap.node_id)
        self.index.add(snap.node_id, snap.keys)
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

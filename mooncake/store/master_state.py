"""The store master's metadata: segments, objects, replicas, leases, eviction, tiers.

PURE (DESIGN.md "Conventions"): no I/O, no clocks, no asyncio; `now` (seconds, any monotonic
origin) is an argument and randomness comes from the `random.Random` passed in. Failures are
return values (`Refusal`), never exceptions; an exception here is a bug.

What the outside world must learn is appended to a change list drained by `drain()`: the service
turns `ObjectStored` / `ObjectRemoved` / `ReplicaDropped` into journal events, node
notifications and KV index events, and `Move` into a command to the node that owns both ends.

Semantics (Mooncake Store, PAPER.md §2), with the choices this file makes:
- Two-phase put: `put_start` allocates PENDING replicas on distinct DRAM segments (distinct
  nodes preferred), invisible to `lookup`/`exists`, `put_end` flips them all at once.
  Puts older than `put_timeout_s` are reclaimed by `tick`.
- `lookup` grants/extends a read lease: a leased object is neither evicted nor removed (unless
  forced), and a replica that stops being served while a lease is out (the source of a finished
  move) stays allocated, unseen, until that lease runs out ("retiring").
- Eviction is per object and approximately LRU (one OrderedDict per tier and per segment, split
  unpinned / soft-pinned; hard-pinned objects are never in them, so a scan never walks them).
- SSD tier: an object evicted from DRAM whose node has SSD room is *offloaded* (one SSD copy per
  object; its other DRAM replicas are dropped at once); its DRAM source stays readable until
  `move_done`. A hit served only from SSD starts a *promotion* back to the node's DRAM.
- One move per object at a time. A move whose object is removed meanwhile is "orphaned": its
  destination range stays allocated until the node reports back (or the move times out), so a
  late copy can never land in a range handed to someone else.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from mooncake.store.allocator import Allocator, align_up
from mooncake.store.types import (
    Pin,
    Placement,
    Reason,
    Replica,
    ReplicaState,
    ReportedObject,
    SegmentInfo,
    Tier,
)

__all__ = [
    "OK",
    "Change",
    "DropReason",
    "Lookup",
    "MasterConfig",
    "MasterState",
    "Move",
    "ObjectRemoved",
    "ObjectStored",
    "ObjectView",
    "Ok",
    "PutPlan",
    "Refusal",
    "RemoveReason",
    "ReplicaDropped",
    "ReportedObject",
    "Restored",
    "SegmentStatus",
]

_NEVER = float("-inf")


@dataclass(frozen=True)
class MasterConfig:
    lease_s: float = 10.0  # read lease granted by a lookup; blocks remove and eviction
    high_watermark: float = 0.90  # evict when DRAM usage (over all DRAM segments) exceeds this
    evict_fraction: float = 0.05  # ... freeing this share of capacity (approx LRU)
    put_timeout_s: float = 30.0  # a pending put (or move) older than this is a zombie
    node_timeout_s: float = 10.0  # no heartbeat for this long: node dead, its replicas dropped
    alignment: int = 64

    def __post_init__(self) -> None:
        if not 0.0 < self.high_watermark <= 1.0 or not 0.0 <= self.evict_fraction < 1.0:
            raise ValueError("high_watermark must be in (0, 1], evict_fraction in [0, 1)")
        if self.lease_s < 0 or self.put_timeout_s <= 0 or self.node_timeout_s <= 0:
            raise ValueError("lease_s >= 0, put_timeout_s > 0 and node_timeout_s > 0")
        if self.alignment <= 0:
            raise ValueError("alignment must be positive")


# --- results --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ok:
    pass


OK = Ok()


@dataclass(frozen=True, slots=True)
class Refusal:
    reason: Reason
    detail: str = ""


@dataclass(frozen=True, slots=True)
class PutPlan:
    """Where to write: one PENDING replica per requested copy, on distinct segments."""

    key: str
    size: int
    replicas: tuple[Replica, ...]


@dataclass(frozen=True, slots=True)
class Lookup:
    """Complete replicas, DRAM first; readable until `lease_until` (the master's clock)."""

    key: str
    size: int
    replicas: tuple[Replica, ...]
    lease_until: float
    pin: Pin


@dataclass(frozen=True, slots=True)
class Restored:
    adopted: int  # reported replicas adopted as COMPLETE
    rejected: int  # reports skipped: unknown/foreign segment, out of range, overlapping ...


# --- changes for the outside world ----------------------------------------------------------

RemoveReason = Literal["removed", "evicted", "node_lost", "revoked", "reclaimed"]
DropReason = Literal["evicted", "node_lost", "moved"]


@dataclass(frozen=True, slots=True)
class ObjectStored:
    """The object is visible with exactly these complete replicas (emitted on put_end, on
    restore, and again whenever the set of complete replicas changes)."""

    key: str
    size: int
    replicas: tuple[Replica, ...]
    pin: Pin


@dataclass(frozen=True, slots=True)
class ObjectRemoved:
    """The object is gone; `nodes` held a complete replica of it (empty for a put that never
    completed: revoked, reclaimed, or aborted because its segment went away)."""

    key: str
    reason: RemoveReason
    nodes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ReplicaDropped:
    """A complete replica stopped being served; the object survives elsewhere.
    `node_keeps`: the node still holds another complete replica of the key (the SSD copy after
    an offload, the DRAM copy after a promotion), so its KV index entry stays."""

    key: str
    replica: Replica
    reason: DropReason
    node_keeps: bool = False


@dataclass(frozen=True, slots=True)
class Move:
    """Command: copy `src` to `dst` (two segments of the same node), then report
    `move_done(key, dst.segment_id)` or `move_failed(...)`."""

    key: str
    src: Replica
    dst: Replica


Change = ObjectStored | ObjectRemoved | ReplicaDropped | Move


# --- introspection ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ObjectView:
    key: str
    size: int
    pin: Pin
    complete: bool
    replicas: tuple[Replica, ...]
    lease_until: float
    last_access: float
    move: Move | None


@dataclass(frozen=True, slots=True)
class SegmentStatus:
    info: SegmentInfo
    used: int
    largest_free: int
    pending_free: int  # allocated bytes that free themselves (moves, retiring replicas)

    @property
    def free(self) -> int:
        return self.info.size - self.used


# --- internals --------------------------------------------------------------------------------


class _Lru:
    """Keys in least-recently-used order, unpinned and soft-pinned apart (hard: never here)."""

    __slots__ = ("none", "soft")

    def __init__(self) -> None:
        self.none: OrderedDict[str, None] = OrderedDict()
        self.soft: OrderedDict[str, None] = OrderedDict()

    def _of(self, pin: Pin) -> OrderedDict[str, None] | None:
        return self.none if pin is Pin.NONE else self.soft if pin is Pin.SOFT else None

    def add(self, key: str, pin: Pin) -> None:
        od = self._of(pin)
        if od is not None:
            od[key] = None
            od.move_to_end(key)

    def touch(self, key: str, pin: Pin) -> None:
        od = self._of(pin)
        if od is not None and key in od:
            od.move_to_end(key)

    def discard(self, key: str, pin: Pin) -> None:
        od = self._of(pin)
        if od is not None:
            od.pop(key, None)

    def candidates(self) -> Iterator[str]:
        """Oldest first; every unpinned key before any soft-pinned one."""
        yield from self.none
        yield from self.soft


class _Segment:
    __slots__ = ("alloc", "info", "keys", "lru", "pending_free")

    def __init__(self, info: SegmentInfo, alignment: int) -> None:
        self.info = info
        self.alloc = Allocator(info.size, alignment)
        self.keys: set[str] = set()  # objects with a replica (pending or complete) here
        self.lru = _Lru()  # objects with a complete replica here
        self.pending_free = 0


@dataclass(slots=True, eq=False)
class _Node:
    node_id: str
    last_seen: float
    segments: set[str] = field(default_factory=set)


@dataclass(slots=True, eq=False)
class _Move:
    src: Replica
    dst: Replica
    offload: bool  # True: eviction DRAM -> SSD; False: promotion SSD -> DRAM
    started: float
    dst_seg: _Segment


@dataclass(slots=True, eq=False)
class _Obj:
    key: str
    size: int
    pin: Pin
    started: float
    replicas: list[Replica]  # all PENDING (a put) or all COMPLETE; DRAM first
    complete: bool = False
    lease_until: float = _NEVER
    last_access: float = 0.0
    move: _Move | None = None


@dataclass(slots=True, eq=False)
class _Held:
    """A range with no object that frees itself: a retiring replica (at `until`, when the
    leases that may read it are over) or an orphaned move destination (when the node reports,
    or at `until`)."""

    seg: _Segment
    offset: int
    length: int
    until: float
    key: str
    orphan: bool


def _tier_rank(r: Replica) -> int:
    return 0 if r.tier is Tier.DRAM else 1


class MasterState:
    def __init__(self, config: MasterConfig, rng: random.Random) -> None:
        self.config = config
        self._rng = rng
        self._segments: dict[str, _Segment] = {}
        self._nodes: dict[str, _Node] = {}
        self._objects: dict[str, _Obj] = {}
        self._pending: dict[str, _Obj] = {}  # puts in flight
        self._moving: dict[str, _Obj] = {}  # objects with a move in flight
        self._held: list[_Held] = []
        self._tier_lru = {Tier.DRAM: _Lru(), Tier.SSD: _Lru()}
        self._changes: list[Change] = []
        self.stats: dict[str, int] = dict.fromkeys(
            (
                "evicted", "offloaded", "promoted", "moves_failed", "reclaimed", "revoked",
                "nodes_lost", "restore_adopted", "restore_rejected",
            ),
            0,
        )  # fmt: skip

    # --- segments and nodes ---------------------------------------------------------------

    def mount(self, info: SegmentInfo, now: float) -> Ok | Refusal:
        if not info.segment_id or not info.node_id or info.size <= 0:
            return Refusal(Reason.INVALID, f"bad segment {info.segment_id!r} size {info.size}")
        seg = self._segments.get(info.segment_id)
        if seg is not None:
            old = seg.info
            if (old.node_id, old.tier, old.size) != (info.node_id, info.tier, info.size):
                return Refusal(
                    Reason.INVALID,
                    f"segment {info.segment_id} already mounted as {old.node_id}/{old.tier}/"
                    f"{old.size} bytes",
                )
            seg.info = info  # idempotent; endpoints may have moved
        else:
            self._segments[info.segment_id] = _Segment(info, self.config.alignment)
        node = self._nodes.get(info.node_id)
        if node is None:
            node = self._nodes[info.node_id] = _Node(info.node_id, now)
        node.last_seen = max(node.last_seen, now)
        node.segments.add(info.segment_id)
        return OK

    def unmount(self, segment_id: str, now: float) -> list[str]:
        """Drop a segment and its replicas; the keys of visible objects that lost their last
        replica (puts in flight on it are aborted too, with an `ObjectRemoved`)."""
        seg = self._segments.get(segment_id)
        return [] if seg is None else self._drop_segment(seg, now)

    def heartbeat(self, node_id: str, now: float) -> Ok | Refusal:
        node = self._nodes.get(node_id)
        if node is None:  # never mounted, timed out, or the master restarted: re-mount
            return Refusal(Reason.UNKNOWN_NODE, node_id)
        node.last_seen = max(node.last_seen, now)
        return OK

    def restore(
        self,
        node_id: str,
        segments: Sequence[SegmentInfo],
        objects: Iterable[ReportedObject],
        now: float,
    ) -> Restored | Refusal:
        """A node (re-)mounts and reports the objects whose bytes it holds: adopt them as
        COMPLETE replicas at exactly those ranges."""
        if any(s.node_id != node_id for s in segments):
            return Refusal(Reason.INVALID, f"a segment of another node in {node_id}'s mount")
        mounted = {s.segment_id for s in segments if isinstance(self.mount(s, now), Ok)}
        adopted = rejected = 0
        changed: dict[str, _Obj] = {}
        for rep in objects:
            verdict = self._adopt(rep, now) if rep.segment_id in mounted else None
            if verdict is None:
                rejected += 1
            else:
                adopted += 1
                changed[verdict.key] = verdict
        for obj in changed.values():
            self._stored(obj)
        self.stats["restore_adopted"] += adopted
        self.stats["restore_rejected"] += rejected
        return Restored(adopted, rejected)

    def _adopt(self, rep: ReportedObject, now: float) -> _Obj | None:
        """The object now holding the reported replica (adopted now, or already known exactly
        as reported: a node re-mounting to a master that never lost it), None if rejected."""
        seg = self._segments[rep.segment_id]
        obj = self._objects.get(rep.key)
        if obj is not None:
            same = [r for r in obj.replicas if r.segment_id == rep.segment_id]
            if obj.complete and same and same[0].offset == rep.offset and obj.size == rep.size:
                return obj
            if not obj.complete or same or obj.size != rep.size:
                return None
        if not rep.key or rep.size <= 0 or not seg.alloc.reserve(rep.offset, rep.size):
            return None
        if obj is None:
            obj = _Obj(rep.key, rep.size, rep.pin, now, [], complete=True, last_access=now)
            self._objects[rep.key] = obj
        info = seg.info
        self._attach(
            obj,
            Replica(
                info.segment_id, info.node_id, info.tier, rep.offset, rep.size,
                ReplicaState.COMPLETE,
            ),
        )  # fmt: skip
        return obj

    # --- two-phase put ----------------------------------------------------------------------

    def put_start(
        self,
        key: str,
        size: int,
        now: float,
        *,
        replicas: int = 1,
        preferred_segment: str | None = None,
        pin: Pin = Pin.NONE,
        placement: Placement = Placement.MOST_FREE,
    ) -> PutPlan | Refusal:
        if not key or size <= 0 or replicas < 1:
            return Refusal(Reason.INVALID, f"key={key!r} size={size} replicas={replicas}")
        if key in self._objects:
            return Refusal(Reason.EXISTS, key)
        dram = [s for s in self._segments.values() if s.info.tier is Tier.DRAM]
        if len(dram) < replicas:
            return Refusal(
                Reason.NOT_ENOUGH_SEGMENTS, f"{replicas} replicas, {len(dram)} DRAM segments"
            )
        need = align_up(size, self.config.alignment)
        big = [s for s in dram if s.info.size >= need]
        if len(big) < replicas:
            return Refusal(Reason.NO_SPACE, f"{size} bytes fit in {len(big)} segment(s)")
        chosen = self._choose(big, need, replicas, preferred_segment, placement)
        if chosen is None:
            self._make_room(big, need, replicas, now)
            chosen = self._choose(big, need, replicas, preferred_segment, placement)
        if chosen is None:
            if any(s.pending_free and s.alloc.free_bytes + s.pending_free >= need for s in big):
                return Refusal(Reason.RETRY_LATER, "room is being made: moves in flight")
            return Refusal(Reason.NO_SPACE, f"{size} bytes x {replicas} after eviction")
        obj = _Obj(key, size, pin, now, [])
        for seg in chosen:
            self._attach(obj, self._alloc(seg, size))
        self._objects[key] = obj
        self._pending[key] = obj
        return PutPlan(key, size, tuple(obj.replicas))

    def put_end(self, key: str, now: float) -> Ok | Refusal:
        obj = self._pending.pop(key, None)
        if obj is None:
            return Refusal(Reason.NOT_PENDING, key)
        obj.complete = True
        obj.last_access = now
        obj.replicas = [replace(r, state=ReplicaState.COMPLETE) for r in obj.replicas]
        for r in obj.replicas:
            self._segments[r.segment_id].lru.add(key, obj.pin)
            self._tier_lru[r.tier].add(key, obj.pin)
        self._stored(obj)
        return OK

    def put_revoke(self, key: str, now: float) -> Ok | Refusal:
        obj = self._pending.get(key)
        if obj is None:
            return Refusal(Reason.NOT_PENDING, key)
        self._abort_put(obj, "revoked")
        self.stats["revoked"] += 1
        return OK

    def _choose(
        self,
        segs: list[_Segment],
        need: int,
        replicas: int,
        preferred: str | None,
        placement: Placement,
    ) -> list[_Segment] | None:
        fit = [s for s in segs if s.alloc.largest_free >= need]
        if len(fit) < replicas:
            return None
        if placement is Placement.RANDOM:
            self._rng.shuffle(fit)
        else:
            fit.sort(key=lambda s: (-s.alloc.free_bytes, s.info.segment_id))
        fit.sort(key=lambda s: s.info.segment_id != preferred)  # stable: preferred first
        chosen: list[_Segment] = []
        nodes: set[str] = set()
        for s in fit:  # distinct nodes first, then distinct segments on used nodes
            if s.info.node_id not in nodes:
                chosen.append(s)
                nodes.add(s.info.node_id)
        chosen += [s for s in fit if s not in chosen]
        return chosen[:replicas]

    def _make_room(self, segs: list[_Segment], need: int, replicas: int, now: float) -> None:
        have = sum(1 for s in segs if s.alloc.largest_free >= need)
        for seg in sorted(segs, key=lambda s: -s.alloc.free_bytes):
            if have >= replicas:
                return
            if seg.alloc.largest_free < need:
                self._evict_segment(seg, need, now, wait_for_moves=True)
                have += seg.alloc.largest_free >= need

    # --- reads --------------------------------------------------------------------------------

    def lookup(self, key: str, now: float) -> Lookup | Refusal:
        obj = self._objects.get(key)
        if obj is None or not obj.complete:
            return Refusal(Reason.NOT_FOUND, key)
        obj.lease_until = max(obj.lease_until, now + self.config.lease_s)
        obj.last_access = now
        self._touch(obj)
        if obj.move is None and obj.replicas[0].tier is Tier.SSD:
            self._promote(obj, now)
        return Lookup(key, obj.size, tuple(obj.replicas), obj.lease_until, obj.pin)

    def lookup_many(self, keys: Iterable[str], now: float) -> list[Lookup | Refusal]:
        return [self.lookup(k, now) for k in keys]

    def exists_many(self, keys: Iterable[str]) -> list[bool]:
        objects = self._objects
        return [(o := objects.get(k)) is not None and o.complete for k in keys]

    def remove(self, key: str, now: float, *, force: bool = False) -> Ok | Refusal:
        obj = self._objects.get(key)
        if obj is None or not obj.complete:
            return Refusal(Reason.NOT_FOUND, key)
        if obj.lease_until > now and not force:
            return Refusal(Reason.LEASED, f"{key} leased until {obj.lease_until}")
        nodes = self._holders(obj)
        for r in list(obj.replicas):
            self._detach(obj, r)
            self._free(r)
        self._forget(obj, now)
        self._changes.append(ObjectRemoved(key, "removed", nodes))
        return OK

    # --- moves (SSD offload and promotion) ----------------------------------------------------

    def move_done(self, key: str, dst_segment_id: str, now: float) -> Ok | Refusal:
        obj = self._moving.get(key)
        mv = obj.move if obj is not None else None
        if obj is None or mv is None or mv.dst.segment_id != dst_segment_id:
            self._release_orphan(key, dst_segment_id)
            return Refusal(Reason.NOT_FOUND, f"no move of {key} to {dst_segment_id}")
        self._end_move(obj)
        self._attach(obj, replace(mv.dst, state=ReplicaState.COMPLETE))
        src = next((r for r in obj.replicas if r.segment_id == mv.src.segment_id), None)
        if src is not None:
            self._detach(obj, src)
            if obj.lease_until > now:  # a reader may hold its address: free it later
                seg = self._segments[src.segment_id]
                self._hold(seg, key, src, obj.lease_until, orphan=False)
            else:
                self._free(src)
            reason: DropReason = "evicted" if mv.offload else "moved"
            keeps = any(r.node_id == src.node_id for r in obj.replicas)
            self._changes.append(ReplicaDropped(key, src, reason, keeps))
        self.stats["offloaded" if mv.offload else "promoted"] += 1
        self._stored(obj)
        return OK

    def move_failed(self, key: str, dst_segment_id: str, now: float) -> Ok | Refusal:
        obj = self._moving.get(key)
        mv = obj.move if obj is not None else None
        if obj is None or mv is None or mv.dst.segment_id != dst_segment_id:
            self._release_orphan(key, dst_segment_id)
            return Refusal(Reason.NOT_FOUND, f"no move of {key} to {dst_segment_id}")
        self._fail_move(obj, now)
        return OK

    def _start_move(self, obj: _Obj, src: Replica, dst: Replica, now: float) -> None:
        offload = src.tier is Tier.DRAM
        obj.move = _Move(src, dst, offload, now, self._segments[dst.segment_id])
        self._moving[obj.key] = obj
        if offload:  # the source frees itself once the move lands
            self._segments[src.segment_id].pending_free += self._aligned(src.size)
        self._changes.append(Move(obj.key, src, dst))

    def _end_move(self, obj: _Obj) -> _Move:
        mv = obj.move
        assert mv is not None
        obj.move = None
        del self._moving[obj.key]
        if mv.offload:
            seg = self._segments.get(mv.src.segment_id)
            if seg is not None:
                seg.pending_free -= self._aligned(mv.src.size)
        return mv

    def _cancel_move(self, obj: _Obj) -> _Move:
        mv = self._end_move(obj)
        if self._segments.get(mv.dst.segment_id) is mv.dst_seg:
            mv.dst_seg.alloc.free(mv.dst.offset)
        self.stats["moves_failed"] += 1
        return mv

    def _fail_move(self, obj: _Obj, now: float) -> None:
        mv = self._cancel_move(obj)
        src = next((r for r in obj.replicas if r.segment_id == mv.src.segment_id), None)
        # A failed offload was an eviction: finish it by dropping the source, unless a reader
        # leased the object meanwhile (then it simply stays in DRAM).
        if mv.offload and src is not None and obj.lease_until <= now:
            self._drop_replicas(obj, [src], "evicted", now)

    def _promote(self, obj: _Obj, now: float) -> None:
        src = obj.replicas[0]
        node = self._nodes.get(src.node_id)
        if node is None:
            return
        need = self._aligned(obj.size)
        dram = [
            s for sid in sorted(node.segments)
            if (s := self._segments[sid]).info.tier is Tier.DRAM and s.info.size >= need
        ]  # fmt: skip
        seg = self._room_on(dram, need, now, exclude=obj.key, wait_for_moves=True)
        # Making room offloads other objects to the SSD, which may have evicted this one there.
        if seg is not None and self._objects.get(obj.key) is obj and src in obj.replicas:
            self._start_move(obj, src, self._alloc(seg, obj.size), now)

    def _room_on(
        self, segs: list[_Segment], need: int, now: float, *, exclude: str, wait_for_moves: bool
    ) -> _Segment | None:
        """A segment of `segs` with `need` contiguous free bytes, evicting for it if needed."""
        for seg in sorted(segs, key=lambda s: -s.alloc.free_bytes):
            if seg.alloc.largest_free >= need:
                return seg
        for seg in segs:
            self._evict_segment(seg, need, now, exclude=exclude, wait_for_moves=wait_for_moves)
            if seg.alloc.largest_free >= need:
                return seg
        return None

    # --- time ----------------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        cfg = self.config
        self._release_held(now)
        for obj in [o for o in self._pending.values() if now - o.started > cfg.put_timeout_s]:
            self._abort_put(obj, "reclaimed")
            self.stats["reclaimed"] += 1
        for obj in list(self._moving.values()):
            if obj.move is not None and now - obj.move.started > cfg.put_timeout_s:
                self._fail_move(obj, now)
        for node in [n for n in self._nodes.values() if now - n.last_seen > cfg.node_timeout_s]:
            for sid in sorted(node.segments):
                self._drop_segment(self._segments[sid], now)
            del self._nodes[node.node_id]
            self.stats["nodes_lost"] += 1
        self._evict_over_watermark(now)

    # --- eviction --------------------------------------------------------------------------------

    def _evict_over_watermark(self, now: float) -> None:
        cap = used = pending = 0
        for s in self._segments.values():
            if s.info.tier is Tier.DRAM:
                cap += s.info.size
                used += s.alloc.used
                pending += s.pending_free
        if cap == 0 or used - pending <= self.config.high_watermark * cap:
            return
        target = (self.config.high_watermark - self.config.evict_fraction) * cap
        victims = self._gather(self._tier_lru[Tier.DRAM], used - pending - target, now, Tier.DRAM)
        for obj in victims:
            if self._objects.get(obj.key) is obj and obj.move is None:
                self._evict_dram(obj, now)

    def _evict_segment(
        self,
        seg: _Segment,
        need: int,
        now: float,
        *,
        exclude: str | None = None,
        wait_for_moves: bool = False,
    ) -> None:
        """Evict LRU objects with a replica on `seg` until it has `need` contiguous bytes, or
        (`wait_for_moves`) until the moves already in flight will free enough."""
        while seg.alloc.largest_free < need:
            free = seg.alloc.free_bytes
            if wait_for_moves and seg.pending_free and free + seg.pending_free >= need:
                return
            victims = self._gather(seg.lru, max(need - free, 1), now, None, exclude)
            if not victims:
                return
            for obj in victims:
                if self._objects.get(obj.key) is not obj or obj.move is not None:
                    continue
                if seg.info.tier is Tier.DRAM:
                    self._evict_dram(obj, now)
                else:
                    on_seg = [r for r in obj.replicas if r.segment_id == seg.info.segment_id]
                    self._drop_replicas(obj, on_seg, "evicted", now)
                    self.stats["evicted"] += 1

    def _gather(
        self, lru: _Lru, nbytes: float, now: float, tier: Tier | None, exclude: str | None = None
    ) -> list[_Obj]:
        """Evictable objects, oldest first, until they hold `nbytes` (in `tier`; one replica
        each when `tier` is None): not leased, not moving, not `exclude`."""
        out: list[_Obj] = []
        got = 0
        for key in lru.candidates():
            obj = self._objects[key]
            if obj.lease_until > now or obj.move is not None or key == exclude:
                continue
            out.append(obj)
            unit = self._aligned(obj.size)
            got += unit if tier is None else unit * sum(r.tier is tier for r in obj.replicas)
            if got >= nbytes:
                break
        return out

    def _evict_dram(self, obj: _Obj, now: float) -> None:
        """Evict `obj` from DRAM: offload one copy to its node's SSD when there is (or can be
        made) room and no SSD copy exists yet; drop the other DRAM replicas."""
        dram = [r for r in obj.replicas if r.tier is Tier.DRAM]
        if not dram:
            return
        self.stats["evicted"] += 1
        src: Replica | None = None
        if all(r.tier is Tier.DRAM for r in obj.replicas):
            for r in dram:
                dst = self._ssd_room(r.node_id, obj, now)
                if dst is not None:
                    src = r
                    self._start_move(obj, r, dst, now)
                    break
        drop = [r for r in dram if r is not src]
        if drop:
            self._drop_replicas(obj, drop, "evicted", now)

    def _ssd_room(self, node_id: str, obj: _Obj, now: float) -> Replica | None:
        node = self._nodes.get(node_id)
        if node is None:
            return None
        need = self._aligned(obj.size)
        ssd = [
            s for sid in sorted(node.segments)
            if (s := self._segments[sid]).info.tier is Tier.SSD and s.info.size >= need
        ]  # fmt: skip
        seg = self._room_on(ssd, need, now, exclude=obj.key, wait_for_moves=False)
        return None if seg is None else self._alloc(seg, obj.size)

    # --- bookkeeping -----------------------------------------------------------------------------

    def _aligned(self, n: int) -> int:
        return align_up(n, self.config.alignment)

    def _alloc(self, seg: _Segment, size: int) -> Replica:
        offset = seg.alloc.allocate(size)
        assert offset is not None, "caller checked largest_free"
        i = seg.info
        return Replica(i.segment_id, i.node_id, i.tier, offset, size, ReplicaState.PENDING)

    def _free(self, r: Replica) -> None:
        self._segments[r.segment_id].alloc.free(r.offset)

    def _attach(self, obj: _Obj, r: Replica) -> None:
        obj.replicas.append(r)
        obj.replicas.sort(key=_tier_rank)
        seg = self._segments[r.segment_id]
        seg.keys.add(obj.key)
        if r.state is ReplicaState.COMPLETE:
            seg.lru.add(obj.key, obj.pin)
            self._tier_lru[r.tier].add(obj.key, obj.pin)

    def _detach(self, obj: _Obj, r: Replica) -> None:
        obj.replicas.remove(r)
        seg = self._segments[r.segment_id]
        seg.keys.discard(obj.key)
        seg.lru.discard(obj.key, obj.pin)
        if not any(x.tier is r.tier for x in obj.replicas):
            self._tier_lru[r.tier].discard(obj.key, obj.pin)

    def _touch(self, obj: _Obj) -> None:
        key, pin = obj.key, obj.pin
        if pin is Pin.HARD:
            return
        tiers: set[Tier] = set()
        for r in obj.replicas:
            self._segments[r.segment_id].lru.touch(key, pin)
            tiers.add(r.tier)
        for t in tiers:
            self._tier_lru[t].touch(key, pin)

    def _holders(self, obj: _Obj) -> tuple[str, ...]:
        if not obj.complete:
            return ()
        return tuple(sorted({r.node_id for r in obj.replicas}))

    def _stored(self, obj: _Obj) -> None:
        self._changes.append(ObjectStored(obj.key, obj.size, tuple(obj.replicas), obj.pin))

    def _forget(self, obj: _Obj, now: float) -> None:
        """Remove an object with no replicas left; a move in flight becomes an orphan whose
        destination stays allocated until the node answers (or the move times out)."""
        del self._objects[obj.key]
        self._pending.pop(obj.key, None)
        if obj.move is not None:
            mv = self._end_move(obj)
            if self._segments.get(mv.dst.segment_id) is mv.dst_seg:
                until = mv.started + self.config.put_timeout_s
                self._hold(mv.dst_seg, obj.key, mv.dst, max(until, now), orphan=True)

    def _drop_replicas(
        self, obj: _Obj, reps: list[Replica], reason: Literal["evicted", "node_lost"], now: float
    ) -> None:
        nodes = self._holders(obj)
        for r in reps:
            self._detach(obj, r)
            self._free(r)
        if not obj.replicas:
            self._forget(obj, now)
            self._changes.append(ObjectRemoved(obj.key, reason, nodes))
            return
        for r in reps:
            keeps = any(x.node_id == r.node_id for x in obj.replicas)
            self._changes.append(ReplicaDropped(obj.key, r, reason, keeps))
        self._stored(obj)

    def _abort_put(self, obj: _Obj, reason: RemoveReason) -> None:
        for r in list(obj.replicas):
            self._detach(obj, r)
            self._free(r)
        del self._objects[obj.key]
        del self._pending[obj.key]
        self._changes.append(ObjectRemoved(obj.key, reason, ()))

    def _drop_segment(self, seg: _Segment, now: float) -> list[str]:
        sid = seg.info.segment_id
        for moving in list(self._moving.values()):
            mv = moving.move
            if mv is not None and sid in (mv.src.segment_id, mv.dst.segment_id):
                self._cancel_move(moving)  # the source, if it is here, goes with the segment
        removed: list[str] = []
        for key in sorted(seg.keys):
            obj = self._objects.get(key)
            if obj is None:
                continue
            if not obj.complete:
                self._abort_put(obj, "node_lost")
                continue
            on_seg = [r for r in obj.replicas if r.segment_id == sid]
            self._drop_replicas(obj, on_seg, "node_lost", now)
            if key not in self._objects:
                removed.append(key)
        for h in [h for h in self._held if h.seg is seg]:
            self._held.remove(h)
        del self._segments[sid]
        node = self._nodes.get(seg.info.node_id)
        if node is not None:
            node.segments.discard(sid)
        return removed

    def _hold(self, seg: _Segment, key: str, r: Replica, until: float, *, orphan: bool) -> None:
        length = self._aligned(r.size)
        seg.pending_free += length
        self._held.append(_Held(seg, r.offset, length, until, key, orphan))

    def _release(self, h: _Held) -> None:
        self._held.remove(h)
        if self._segments.get(h.seg.info.segment_id) is h.seg:
            h.seg.pending_free -= h.length
            h.seg.alloc.free(h.offset)

    def _release_held(self, now: float) -> None:
        for h in [h for h in self._held if h.until <= now]:
            self._release(h)

    def _release_orphan(self, key: str, segment_id: str) -> None:
        for h in self._held:
            if h.orphan and h.key == key and h.seg.info.segment_id == segment_id:
                self._release(h)
                return

    # --- introspection ---------------------------------------------------------------------------

    def drain(self) -> list[Change]:
        out, self._changes = self._changes, []
        return out

    def __len__(self) -> int:
        """Visible (complete) objects."""
        return len(self._objects) - len(self._pending)

    def object(self, key: str) -> ObjectView | None:
        obj = self._objects.get(key)
        if obj is None:
            return None
        mv = obj.move
        return ObjectView(
            obj.key, obj.size, obj.pin, obj.complete, tuple(obj.replicas), obj.lease_until,
            obj.last_access, None if mv is None else Move(obj.key, mv.src, mv.dst),
        )  # fmt: skip

    def segment(self, segment_id: str) -> SegmentInfo | None:
        seg = self._segments.get(segment_id)
        return None if seg is None else seg.info

    def segments(self) -> list[SegmentStatus]:
        return [
            SegmentStatus(s.info, s.alloc.used, s.alloc.largest_free, s.pending_free)
            for s in self._segments.values()
        ]

    def nodes(self) -> list[str]:
        return sorted(self._nodes)

    def node_objects(self, node_id: str) -> list[tuple[str, Replica, Pin]]:
        """Complete replicas held by a node's segments: (key, replica, pin)."""
        node = self._nodes.get(node_id)
        out: list[tuple[str, Replica, Pin]] = []
        for sid in sorted(node.segments) if node else ():
            for key in sorted(self._segments[sid].keys):
                obj = self._objects[key]
                if obj.complete:
                    out += [(key, r, obj.pin) for r in obj.replicas if r.segment_id == sid]
        return out

    def usage(self) -> dict[str, dict[str, int]]:
        out = {t.value: {"capacity": 0, "used": 0, "pending_free": 0, "segments": 0} for t in Tier}
        for s in self._segments.values():
            u = out[s.info.tier.value]
            u["capacity"] += s.info.size
            u["used"] += s.alloc.used
            u["pending_free"] += s.pending_free
            u["segments"] += 1
        return out

    def ranges(self) -> dict[str, list[tuple[int, int, str]]]:
        """Every range the metadata says is allocated, per segment: (offset, aligned length,
        owner), where owner is the key, "key>move" (a move destination) or "key~held"."""
        out: dict[str, list[tuple[int, int, str]]] = {sid: [] for sid in self._segments}
        for obj in self._objects.values():
            for r in obj.replicas:
                out[r.segment_id].append((r.offset, self._aligned(r.size), obj.key))
        for moving in self._moving.values():
            if moving.move is not None:
                d = moving.move.dst
                out[d.segment_id].append((d.offset, self._aligned(d.size), moving.key + ">move"))
        for h in self._held:
            out[h.seg.info.segment_id].append((h.offset, h.length, h.key + "~held"))
        for lst in out.values():
            lst.sort()
        return out

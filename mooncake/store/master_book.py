"""The store master's book: its tables and the primitives that keep them consistent.

`Book` owns every mutable table of the master state (segments, nodes, objects, puts and moves
in flight, held ranges, the per-tier LRUs, the owners' accounts, the change list, the
counters) and the operations that must update several of them together: allocate/free,
attach/detach a replica (segment keys, LRUs and the owner's bytes follow), drop replicas or a
whole segment, abort a put, hold a range that frees itself later, start/end/cancel a move
(the destination is charged to the owner while it is in flight). The public API
(`master_state.MasterState`) and the eviction and tier policy (`master_tiers`) act only
through it.

PURE, like the rest of the master state; semantics: `master_state`'s module docstring.
"""

from __future__ import annotations

from typing import Literal

from mooncake.store.allocator import align_up
from mooncake.store.master_records import (
    _Account,
    _Held,
    _Lru,
    _Move,
    _Node,
    _Obj,
    _Segment,
    _tier_rank,
)
from mooncake.store.master_types import (
    Change,
    MasterConfig,
    Move,
    ObjectRemoved,
    ObjectStored,
    RemoveReason,
    ReplicaDropped,
)
from mooncake.store.types import Pin, Replica, ReplicaState, Tier


class Book:
    """The master's tables. Every field is shared with `master_nodes`, `master_tiers`,
    `master_views` and `MasterState`, which read them freely but change several of them at once
    only through the methods below (they keep segment keys, LRUs and pending_free in step)."""

    def __init__(self, config: MasterConfig) -> None:
        self.config = config
        self.segments: dict[str, _Segment] = {}
        self.nodes: dict[str, _Node] = {}
        self.objects: dict[str, _Obj] = {}
        self.pending: dict[str, _Obj] = {}  # puts in flight
        self.moving: dict[str, _Obj] = {}  # objects with a move in flight
        self.held: list[_Held] = []
        self.tier_lru = {Tier.DRAM: _Lru(), Tier.SSD: _Lru()}
        self.accounts: dict[str, _Account] = {}  # per owner; only owners holding bytes
        self.changes: list[Change] = []
        self.stats: dict[str, int] = dict.fromkeys(
            (
                "evicted", "offloaded", "promoted", "moves_failed", "reclaimed", "revoked",
                "nodes_lost", "restore_adopted", "restore_rejected", "restore_dropped",
                "quota_evicted", "quota_refused",
            ),
            0,
        )  # fmt: skip

    # --- allocation and replicas --------------------------------------------------------------

    def aligned(self, n: int) -> int:
        return align_up(n, self.config.alignment)

    def alloc(self, seg: _Segment, size: int) -> Replica:
        offset = seg.alloc.allocate(size)
        assert offset is not None, "caller checked largest_free"
        i = seg.info
        return Replica(i.segment_id, i.node_id, i.tier, offset, size, ReplicaState.PENDING)

    def free(self, r: Replica) -> None:
        self.segments[r.segment_id].alloc.free(r.offset)

    def used(self, owner: str, tier: Tier) -> int:
        acct = self.accounts.get(owner)
        return 0 if acct is None else acct.used[tier]

    def _charge(self, owner: str, r: Replica, sign: int) -> None:
        acct = self.accounts.get(owner)
        if acct is None:
            acct = self.accounts[owner] = _Account()
        acct.used[r.tier] += sign * self.aligned(r.size)
        if not any(acct.used.values()):  # nothing left: no LRU entry either
            del self.accounts[owner]

    def attach(self, obj: _Obj, r: Replica) -> None:
        obj.replicas.append(r)
        obj.replicas.sort(key=_tier_rank)
        self.segments[r.segment_id].keys.add(obj.key)
        self._charge(obj.owner, r, +1)
        if r.state is ReplicaState.COMPLETE:
            self.listed(obj, r)

    def listed(self, obj: _Obj, r: Replica) -> None:
        """A complete replica joins the LRUs it is evicted from: its segment's, its tier's,
        its owner's in that tier."""
        self.segments[r.segment_id].lru.add(obj.key, obj.pin)
        self.tier_lru[r.tier].add(obj.key, obj.pin)
        self.accounts[obj.owner].lru[r.tier].add(obj.key, obj.pin)

    def detach(self, obj: _Obj, r: Replica) -> None:
        obj.replicas.remove(r)
        seg = self.segments[r.segment_id]
        seg.keys.discard(obj.key)
        seg.lru.discard(obj.key, obj.pin)
        if not any(x.tier is r.tier for x in obj.replicas):
            self.tier_lru[r.tier].discard(obj.key, obj.pin)
            self.accounts[obj.owner].lru[r.tier].discard(obj.key, obj.pin)
        self._charge(obj.owner, r, -1)

    def touch(self, obj: _Obj) -> None:
        key, pin = obj.key, obj.pin
        if pin is Pin.HARD:
            return
        tiers: set[Tier] = set()
        for r in obj.replicas:
            self.segments[r.segment_id].lru.touch(key, pin)
            tiers.add(r.tier)
        acct = self.accounts[obj.owner]
        for t in tiers:
            self.tier_lru[t].touch(key, pin)
            acct.lru[t].touch(key, pin)

    def holders(self, obj: _Obj) -> tuple[str, ...]:
        if not obj.complete:
            return ()
        return tuple(sorted({r.node_id for r in obj.replicas}))

    def stored(self, obj: _Obj) -> None:
        self.changes.append(ObjectStored(obj.key, obj.size, tuple(obj.replicas), obj.pin))

    # --- removal ------------------------------------------------------------------------------

    def forget(self, obj: _Obj, now: float) -> None:
        """Remove an object with no replicas left; a move in flight becomes an orphan whose
        destination stays allocated until the node answers (or the move times out)."""
        del self.objects[obj.key]
        self.pending.pop(obj.key, None)
        if obj.move is not None:
            mv = self.end_move(obj)
            if self.segments.get(mv.dst.segment_id) is mv.dst_seg:
                until = mv.started + self.config.put_timeout_s
                self.hold(mv.dst_seg, obj.key, mv.dst, max(until, now), orphan=True)

    def drop_replicas(
        self, obj: _Obj, reps: list[Replica], reason: Literal["evicted", "node_lost"], now: float
    ) -> None:
        nodes = self.holders(obj)
        for r in reps:
            self.detach(obj, r)
            self.free(r)
        if not obj.replicas:
            self.forget(obj, now)
            self.changes.append(ObjectRemoved(obj.key, reason, nodes))
            return
        for r in reps:
            keeps = any(x.node_id == r.node_id for x in obj.replicas)
            self.changes.append(ReplicaDropped(obj.key, r, reason, keeps))
        self.stored(obj)

    def abort_put(self, obj: _Obj, reason: RemoveReason) -> None:
        for r in list(obj.replicas):
            self.detach(obj, r)
            self.free(r)
        del self.objects[obj.key]
        del self.pending[obj.key]
        self.changes.append(ObjectRemoved(obj.key, reason, ()))

    def drop_segment(self, seg: _Segment, now: float) -> list[str]:
        sid = seg.info.segment_id
        for moving in list(self.moving.values()):
            mv = moving.move
            if mv is not None and sid in (mv.src.segment_id, mv.dst.segment_id):
                self.cancel_move(moving)  # the source, if it is here, goes with the segment
        removed: list[str] = []
        for key in sorted(seg.keys):
            obj = self.objects.get(key)
            if obj is None:
                continue
            if not obj.complete:
                self.abort_put(obj, "node_lost")
                continue
            on_seg = [r for r in obj.replicas if r.segment_id == sid]
            self.drop_replicas(obj, on_seg, "node_lost", now)
            if key not in self.objects:
                removed.append(key)
        for h in [h for h in self.held if h.seg is seg]:
            self.held.remove(h)
        del self.segments[sid]
        node = self.nodes.get(seg.info.node_id)
        if node is not None:
            node.segments.discard(sid)
        return removed

    # --- ranges that free themselves (retiring replicas, orphaned move destinations) ---------

    def hold(self, seg: _Segment, key: str, r: Replica, until: float, *, orphan: bool) -> None:
        length = self.aligned(r.size)
        seg.pending_free += length
        self.held.append(_Held(seg, r.offset, length, until, key, orphan))

    def release(self, h: _Held) -> None:
        self.held.remove(h)
        if self.segments.get(h.seg.info.segment_id) is h.seg:
            h.seg.pending_free -= h.length
            h.seg.alloc.free(h.offset)

    def release_held(self, now: float) -> None:
        for h in [h for h in self.held if h.until <= now]:
            self.release(h)

    def release_orphan(self, key: str, segment_id: str) -> None:
        for h in self.held:
            if h.orphan and h.key == key and h.seg.info.segment_id == segment_id:
                self.release(h)
                return

    # --- moves in flight --------------------------------------------------------------------

    def start_move(self, obj: _Obj, src: Replica, dst: Replica, now: float) -> None:
        offload = src.tier is Tier.DRAM
        obj.move = _Move(src, dst, offload, now, self.segments[dst.segment_id])
        self.moving[obj.key] = obj
        self._charge(obj.owner, dst, +1)
        if offload:  # the source frees itself once the move lands
            self.segments[src.segment_id].pending_free += self.aligned(src.size)
        self.changes.append(Move(obj.key, src, dst))

    def end_move(self, obj: _Obj) -> _Move:
        mv = obj.move
        assert mv is not None
        obj.move = None
        del self.moving[obj.key]
        self._charge(obj.owner, mv.dst, -1)
        if mv.offload:
            seg = self.segments.get(mv.src.segment_id)
            if seg is not None:
                seg.pending_free -= self.aligned(mv.src.size)
        return mv

    def cancel_move(self, obj: _Obj) -> _Move:
        mv = self.end_move(obj)
        if self.segments.get(mv.dst.segment_id) is mv.dst_seg:
            mv.dst_seg.alloc.free(mv.dst.offset)
        self.stats["moves_failed"] += 1
        return mv

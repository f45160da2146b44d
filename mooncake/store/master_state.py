"""The store master's metadata: segments, objects, replicas, leases, eviction, tiers.

PURE (DESIGN.md "Conventions"): no I/O, no clocks, no asyncio; `now` (seconds, any monotonic
origin) is an argument and randomness comes from the `random.Random` passed in. Failures are
return values (`Refusal`), never exceptions; an exception here is a bug.

What the outside world must learn is appended to a change list drained by `drain()`: the service
turns `ObjectStored` / `ObjectRemoved` / `ReplicaDropped` into journal events, node
notifications and KV index events, and `Move` into a command to the node that owns both ends.

Semantics (Mooncake Store, PAPER.md §2), with the choices made here:
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
- Quotas: every object is owned by the cache namespace its put names (`DEFAULT_OWNER` when
  none), which is charged the aligned bytes of its replicas per tier, pending and complete,
  and of its moves' destinations in flight. A DRAM allocation (a put, a promotion) or an
  offload that would take the owner over its cap (`MasterConfig.quotas`) first evicts the
  owner's own LRU objects in that tier, by the rules above; a put it cannot make room for is
  refused with `QUOTA` (`RETRY_LATER` when the owner's moves in flight will), a promotion is
  skipped, and an offload becomes a drop. Other owners' objects are never evicted for a
  quota; the watermark and the room for an allocation are pool-wide, as without quotas.
  Restore adopts what a node reports whatever the quotas (the bytes are there already).
- Object count: the table holds at most `MasterConfig.max_objects` objects, pending puts
  included (the master's memory is bounded by it, not by the pool's bytes). A put that would
  exceed it first evicts the least recently used objects whole, by the rules above (no
  offload: an SSD copy stays in the table), and is refused with `NO_SPACE` when none can go.
  Restore rejects a reported object that would exceed it (the node drops it on its resync).
- One move per object at a time. A move whose object is removed meanwhile is "orphaned": its
  destination range stays allocated until the node reports back (or the move times out), so a
  late copy can never land in a range handed to someone else.

The code is split along these concerns; this docstring is the one description of the semantics:
- `master_types`: the public values (config, results, changes, views), re-exported here;
- `master_records`: the internal mutable records (objects, segments, nodes, moves, LRUs);
- `master_book`: `Book`, the tables and the primitives that keep them consistent;
- `master_nodes`: mount, heartbeat, node expiry and restore (functions of a `Book`);
- `master_tiers`: eviction, SSD offload and promotion, move completion (functions of a `Book`);
- `master_views`: the read-only introspection behind `object`, `segments`, `ranges` ...;
- here: `MasterState`, the API, and the two-phase put, reads and `tick` themselves.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import replace

from mooncake.store import master_nodes, master_tiers, master_views
from mooncake.store.allocator import align_up
from mooncake.store.master_book import Book
from mooncake.store.master_records import _Obj, _Segment
from mooncake.store.master_types import (
    DEFAULT_OWNER,
    OK,
    Change,
    DropReason,
    Lookup,
    MasterConfig,
    Move,
    ObjectRemoved,
    ObjectStored,
    ObjectView,
    Ok,
    PutPlan,
    Quota,
    Refusal,
    RemoveReason,
    ReplicaDropped,
    Restored,
    SegmentStatus,
)
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
    "DEFAULT_OWNER",
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
    "Quota",
    "Refusal",
    "RemoveReason",
    "ReplicaDropped",
    "ReportedObject",
    "Restored",
    "SegmentStatus",
]


class MasterState:
    def __init__(self, config: MasterConfig, rng: random.Random) -> None:
        self.config = config
        self._rng = rng
        self._book = Book(config)

    @property
    def stats(self) -> dict[str, int]:
        """Counters: evicted, offloaded, promoted, moves_failed, reclaimed, revoked, ..."""
        return self._book.stats

    # --- segments and nodes (`master_nodes`) ---------------------------------------------------

    def mount(self, info: SegmentInfo, now: float) -> Ok | Refusal:
        return master_nodes.mount(self._book, info, now)

    def unmount(self, segment_id: str, now: float) -> list[str]:
        """Drop a segment and its replicas; the keys of visible objects that lost their last
        replica (puts in flight on it are aborted too, with an `ObjectRemoved`)."""
        seg = self._book.segments.get(segment_id)
        return [] if seg is None else self._book.drop_segment(seg, now)

    def heartbeat(self, node_id: str, now: float) -> Ok | Refusal:
        return master_nodes.heartbeat(self._book, node_id, now)

    def restore(
        self,
        node_id: str,
        segments: Sequence[SegmentInfo],
        objects: Iterable[ReportedObject],
        now: float,
    ) -> Restored | Refusal:
        """A node (re-)mounts and reports the objects whose bytes it holds: adopt them as
        COMPLETE replicas at exactly those ranges."""
        return master_nodes.restore(self._book, node_id, segments, objects, now)

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
        owner: str = DEFAULT_OWNER,
    ) -> PutPlan | Refusal:
        if not key or size <= 0 or replicas < 1:
            return Refusal(Reason.INVALID, f"key={key!r} size={size} replicas={replicas}")
        if key in self._book.objects:
            return Refusal(Reason.EXISTS, key)
        dram = [s for s in self._book.segments.values() if s.info.tier is Tier.DRAM]
        if len(dram) < replicas:
            return Refusal(
                Reason.NOT_ENOUGH_SEGMENTS, f"{replicas} replicas, {len(dram)} DRAM segments"
            )
        need = align_up(size, self.config.alignment)
        big = [s for s in dram if s.info.size >= need]
        if len(big) < replicas:
            return Refusal(Reason.NO_SPACE, f"{size} bytes fit in {len(big)} segment(s)")
        room = master_tiers.quota_room(self._book, owner, Tier.DRAM, need * replicas, now)
        if isinstance(room, Refusal):
            return room
        room = master_tiers.count_room(self._book, now)
        if isinstance(room, Refusal):
            return room
        chosen = self._choose(big, need, replicas, preferred_segment, placement)
        if chosen is None:
            master_tiers.make_room(self._book, big, need, replicas, now)
            chosen = self._choose(big, need, replicas, preferred_segment, placement)
        if chosen is None:
            if any(s.pending_free and s.alloc.free_bytes + s.pending_free >= need for s in big):
                return Refusal(Reason.RETRY_LATER, "room is being made: moves in flight")
            return Refusal(Reason.NO_SPACE, f"{size} bytes x {replicas} after eviction")
        obj = _Obj(key, size, pin, now, [], owner)
        for seg in chosen:
            self._book.attach(obj, self._book.alloc(seg, size))
        self._book.objects[key] = obj
        self._book.pending[key] = obj
        return PutPlan(key, size, tuple(obj.replicas))

    def put_end(self, key: str, now: float) -> Ok | Refusal:
        obj = self._book.pending.pop(key, None)
        if obj is None:
            return Refusal(Reason.NOT_PENDING, key)
        obj.complete = True
        obj.last_access = now
        obj.replicas = [replace(r, state=ReplicaState.COMPLETE) for r in obj.replicas]
        for r in obj.replicas:
            self._book.listed(obj, r)
        self._book.stored(obj)
        return OK

    def put_renew(self, key: str, now: float) -> Ok | Refusal:
        """A put still being written (a long prefill writes its blocks as it computes them):
        its `put_timeout_s` counts from now, so `tick` does not reclaim it as a zombie."""
        obj = self._book.pending.get(key)
        if obj is None:
            return Refusal(Reason.NOT_PENDING, key)
        obj.started = now
        return OK

    def put_revoke(self, key: str, now: float) -> Ok | Refusal:
        obj = self._book.pending.get(key)
        if obj is None:
            return Refusal(Reason.NOT_PENDING, key)
        self._book.abort_put(obj, "revoked")
        self._book.stats["revoked"] += 1
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

    # --- reads --------------------------------------------------------------------------------

    def lookup(self, key: str, now: float) -> Lookup | Refusal:
        obj = self._book.objects.get(key)
        if obj is None or not obj.complete:
            return Refusal(Reason.NOT_FOUND, key)
        obj.lease_until = max(obj.lease_until, now + self.config.lease_s)
        obj.last_access = now
        self._book.touch(obj)
        if obj.move is None and obj.replicas[0].tier is Tier.SSD:
            master_tiers.promote(self._book, obj, now)
        return Lookup(key, obj.size, tuple(obj.replicas), obj.lease_until, obj.pin)

    def lookup_many(self, keys: Iterable[str], now: float) -> list[Lookup | Refusal]:
        return [self.lookup(k, now) for k in keys]

    def exists_many(self, keys: Iterable[str]) -> list[bool]:
        objects = self._book.objects
        return [(o := objects.get(k)) is not None and o.complete for k in keys]

    def remove(self, key: str, now: float, *, force: bool = False) -> Ok | Refusal:
        obj = self._book.objects.get(key)
        if obj is None or not obj.complete:
            return Refusal(Reason.NOT_FOUND, key)
        if obj.lease_until > now and not force:
            return Refusal(Reason.LEASED, f"{key} leased until {obj.lease_until}")
        nodes = self._book.holders(obj)
        for r in list(obj.replicas):
            self._book.detach(obj, r)
            self._book.free(r)
        self._book.forget(obj, now)
        self._book.changes.append(ObjectRemoved(key, "removed", nodes))
        return OK

    # --- moves (SSD offload and promotion: `master_tiers`) ----------------------------------------

    def move_done(self, key: str, dst_segment_id: str, now: float) -> Ok | Refusal:
        return master_tiers.move_done(self._book, key, dst_segment_id, now)

    def move_failed(self, key: str, dst_segment_id: str, now: float) -> Ok | Refusal:
        return master_tiers.move_failed(self._book, key, dst_segment_id, now)

    # --- time ----------------------------------------------------------------------------------

    def tick(self, now: float) -> None:
        cfg = self.config
        self._book.release_held(now)
        for obj in [o for o in self._book.pending.values() if now - o.started > cfg.put_timeout_s]:
            self._book.abort_put(obj, "reclaimed")
            self._book.stats["reclaimed"] += 1
        for obj in list(self._book.moving.values()):
            if obj.move is not None and now - obj.move.started > cfg.put_timeout_s:
                master_tiers.fail_move(self._book, obj, now)
        master_nodes.expire(self._book, now)
        master_tiers.evict_over_watermark(self._book, now)

    # --- introspection ---------------------------------------------------------------------------

    def drain(self) -> list[Change]:
        out, self._book.changes = self._book.changes, []
        return out

    def __len__(self) -> int:
        """Visible (complete) objects."""
        return len(self._book.objects) - len(self._book.pending)

    def object(self, key: str) -> ObjectView | None:
        return master_views.object_view(self._book, key)

    def segment(self, segment_id: str) -> SegmentInfo | None:
        seg = self._book.segments.get(segment_id)
        return None if seg is None else seg.info

    def segments(self) -> list[SegmentStatus]:
        return master_views.segment_statuses(self._book)

    def nodes(self) -> list[str]:
        return sorted(self._book.nodes)

    def node_objects(self, node_id: str) -> list[tuple[str, Replica, Pin, str]]:
        """Complete replicas held by a node's segments: (key, replica, pin, owner)."""
        return master_views.node_objects(self._book, node_id)

    def usage(self) -> dict[str, dict[str, int]]:
        """Per tier: capacity, used, pending_free (bytes) and segments (count)."""
        return master_views.usage(self._book)

    def usage_by_owner(self) -> dict[str, dict[str, int]]:
        """Per owner holding any bytes, per tier: the bytes charged to it (what its quota
        caps: the aligned bytes of its replicas and of its moves' destinations in flight)."""
        return master_views.usage_by_owner(self._book)

    def ranges(self) -> dict[str, list[tuple[int, int, str]]]:
        """Every range the metadata says is allocated, per segment: (offset, aligned length,
        what), where what is the key, "key>move" (a move destination) or "key~held"."""
        return master_views.ranges(self._book)

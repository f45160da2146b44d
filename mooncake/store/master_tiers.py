"""Eviction and the SSD tier: approximate-LRU eviction, offload to SSD, promotion to DRAM.

Policy over the master's `Book` (functions of it, no state of their own): which objects to
evict and when (over the DRAM high watermark, to make room for a put or a move, or to keep an
owner within its quota), which evicted objects go to their node's SSD instead of away, when
an SSD hit is promoted back, and what a finished or failed move does to the object's
replicas. Every table update goes through the `Book`'s primitives.

One eviction path, scoped by the LRU it gathers from: a tier's (the watermark), a segment's
(room for an allocation there), an owner's in a tier (its quota: only its own objects), both
tiers' (room in the object table: `max_objects`).

PURE, like the rest of the master state; semantics: `master_state`'s module docstring.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import replace
from itertools import chain, islice

from mooncake.store.master_book import Book
from mooncake.store.master_records import _Lru, _Obj, _Segment
from mooncake.store.master_types import OK, DropReason, Ok, Refusal, ReplicaDropped
from mooncake.store.types import Reason, Replica, ReplicaState, Tier

__all__ = [
    "count_room",
    "evict_over_watermark",
    "fail_move",
    "make_room",
    "move_done",
    "move_failed",
    "promote",
    "quota_room",
]

# --- eviction ---------------------------------------------------------------------------------


def make_room(b: Book, segs: list[_Segment], need: int, replicas: int, now: float) -> None:
    """Evict from `segs` until `replicas` of them have `need` contiguous bytes (a segment whose
    moves in flight will free enough is left to them): room for a put."""
    have = sum(1 for s in segs if s.alloc.largest_free >= need)
    for seg in sorted(segs, key=lambda s: -s.alloc.free_bytes):
        if have >= replicas:
            return
        if seg.alloc.largest_free < need:
            _evict_segment(b, seg, need, now, wait_for_moves=True)
            have += seg.alloc.largest_free >= need


def evict_over_watermark(b: Book, now: float) -> None:
    cap = used = pending = 0
    for s in b.segments.values():
        if s.info.tier is Tier.DRAM:
            cap += s.info.size
            used += s.alloc.used
            pending += s.pending_free
    if cap == 0 or used - pending <= b.config.high_watermark * cap:
        return
    target = (b.config.high_watermark - b.config.evict_fraction) * cap
    _evict(b, _gather(b, b.tier_lru[Tier.DRAM], used - pending - target, now, Tier.DRAM), now)


def count_room(b: Book, now: float) -> Ok | Refusal:
    """Room in the object table for one more object (`MasterConfig.max_objects`): the least
    recently used evictable objects go, whole (an offload to SSD would keep them in the
    table), unpinned ones of both tiers before any soft-pinned one, SSD before DRAM (an SSD
    object was already evicted from DRAM once). NO_SPACE when the table is full of objects
    that cannot go (leased, pinned, pending or moving)."""
    over = len(b.objects) + 1 - b.config.max_objects
    if over <= 0:
        return OK
    ssd, dram = b.tier_lru[Tier.SSD], b.tier_lru[Tier.DRAM]
    keys = _once(chain(ssd.none, dram.none, ssd.soft, dram.soft))
    _evict(b, list(islice(_evictable(b, keys, now), over)), now, None)
    if len(b.objects) < b.config.max_objects:
        return OK
    return Refusal(
        Reason.NO_SPACE,
        f"object count limit reached: {len(b.objects)} objects held (max_objects="
        f"{b.config.max_objects}) and none left to evict (leased, pinned, pending or moving)",
    )


def _once(keys: Iterable[str]) -> Iterator[str]:
    """`keys` without repeats (an object adopted with replicas in both tiers is in both
    tiers' LRUs)."""
    seen: set[str] = set()
    for key in keys:
        if key not in seen:
            seen.add(key)
            yield key


def quota_room(
    b: Book, owner: str, tier: Tier, need: int, now: float, *, exclude: str | None = None
) -> Ok | Refusal:
    """Room for `need` more bytes of `owner` in `tier` within its quota: its own LRU objects
    there are evicted for it (never another owner's; the same rules as any eviction), and
    what its moves in flight will take out of the tier counts as leaving (RETRY_LATER when
    only they make room)."""
    cap = b.config.cap(owner, tier)
    if cap is None or b.used(owner, tier) + need <= cap:
        return OK
    if need > cap:
        return _over_quota(b, f"{need} bytes exceed {owner}'s {tier} quota of {cap}")
    over = b.used(owner, tier) + need - cap - _leaving(b, owner, tier)
    if over > 0:
        victims = _gather(b, b.accounts[owner].lru[tier], over, now, tier, exclude)
        b.stats["quota_evicted"] += len(victims)
        _evict(b, victims, now, tier)
        if b.used(owner, tier) + need <= cap:
            return OK
        if b.used(owner, tier) + need - cap - _leaving(b, owner, tier) > 0:
            return _over_quota(b, f"{owner}'s {tier} quota of {cap}: nothing of its to evict")
    return Refusal(Reason.RETRY_LATER, f"room in {owner}'s {tier} quota is being made")


def _leaving(b: Book, owner: str, tier: Tier) -> int:
    """Bytes of `owner` in `tier` that free themselves when its moves in flight land."""
    return sum(
        b.aligned(mv.src.size)
        for obj in b.moving.values()
        if obj.owner == owner and (mv := obj.move) is not None and mv.src.tier is tier
    )


def _over_quota(b: Book, detail: str) -> Refusal:
    b.stats["quota_refused"] += 1
    return Refusal(Reason.QUOTA, detail)


def _evict_segment(
    b: Book,
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
        victims = _gather(b, seg.lru, max(need - free, 1), now, None, exclude)
        if not victims:
            return
        _evict(b, victims, now, seg.info.tier)


def _evictable(
    b: Book, keys: Iterable[str], now: float, exclude: str | None = None
) -> Iterator[_Obj]:
    """The objects of `keys` (LRU order) that may be evicted: not leased, not moving, not
    `exclude`."""
    for key in keys:
        obj = b.objects[key]
        if obj.lease_until > now or obj.move is not None or key == exclude:
            continue
        yield obj


def _gather(
    b: Book, lru: _Lru, nbytes: float, now: float, tier: Tier | None, exclude: str | None = None
) -> list[_Obj]:
    """Evictable objects, oldest first, until they hold `nbytes` (in `tier`; one replica
    each when `tier` is None)."""
    out: list[_Obj] = []
    got = 0
    for obj in _evictable(b, lru.candidates(), now, exclude):
        out.append(obj)
        unit = b.aligned(obj.size)
        got += unit if tier is None else unit * sum(r.tier is tier for r in obj.replicas)
        if got >= nbytes:
            break
    return out


def _evict(b: Book, victims: list[_Obj], now: float, tier: Tier | None = Tier.DRAM) -> None:
    """Evict `victims` (from `_gather`) from `tier`, skipping any that an earlier eviction
    of the batch removed or started moving: from DRAM by `_evict_dram`; from SSD, dropped;
    from everywhere (`tier` None: the object goes, no offload), every replica dropped."""
    for obj in victims:
        if b.objects.get(obj.key) is not obj or obj.move is not None:
            continue
        if tier is Tier.DRAM:
            _evict_dram(b, obj, now)
        else:
            drop = [r for r in obj.replicas if tier is None or r.tier is tier]
            b.drop_replicas(obj, drop, "evicted", now)
            b.stats["evicted"] += 1


def _evict_dram(b: Book, obj: _Obj, now: float) -> None:
    """Evict `obj` from DRAM: offload one copy to its node's SSD when there is (or can be
    made) room and no SSD copy exists yet; drop the other DRAM replicas."""
    dram = [r for r in obj.replicas if r.tier is Tier.DRAM]
    if not dram:
        return
    b.stats["evicted"] += 1
    src: Replica | None = None
    if all(r.tier is Tier.DRAM for r in obj.replicas):
        for r in dram:
            dst = _ssd_room(b, r.node_id, obj, now)
            if dst is not None:
                src = r
                b.start_move(obj, r, dst, now)
                break
    drop = [r for r in dram if r is not src]
    if drop:
        b.drop_replicas(obj, drop, "evicted", now)


def _ssd_room(b: Book, node_id: str, obj: _Obj, now: float) -> Replica | None:
    node = b.nodes.get(node_id)
    if node is None:
        return None
    need = b.aligned(obj.size)
    ssd = [
        s for sid in sorted(node.segments)
        if (s := b.segments[sid]).info.tier is Tier.SSD and s.info.size >= need
    ]  # fmt: skip
    # Within the owner's SSD quota (evicting its own SSD objects), or not offloaded at all.
    if not ssd or not isinstance(quota_room(b, obj.owner, Tier.SSD, need, now), Ok):
        return None
    seg = _room_on(b, ssd, need, now, exclude=obj.key, wait_for_moves=False)
    return None if seg is None else b.alloc(seg, obj.size)


def _room_on(
    b: Book, segs: list[_Segment], need: int, now: float, *, exclude: str, wait_for_moves: bool
) -> _Segment | None:
    """A segment of `segs` with `need` contiguous free bytes, evicting for it if needed."""
    for seg in sorted(segs, key=lambda s: -s.alloc.free_bytes):
        if seg.alloc.largest_free >= need:
            return seg
    for seg in segs:
        _evict_segment(b, seg, need, now, exclude=exclude, wait_for_moves=wait_for_moves)
        if seg.alloc.largest_free >= need:
            return seg
    return None


# --- moves (SSD offload and promotion) ----------------------------------------------------------


def _moving(b: Book, key: str, dst_segment_id: str) -> _Obj | Refusal:
    """The object whose move to `dst_segment_id` a node reports on; a report of no such
    move (the object was removed meanwhile) frees the orphaned destination."""
    obj = b.moving.get(key)
    mv = obj.move if obj is not None else None
    if obj is None or mv is None or mv.dst.segment_id != dst_segment_id:
        b.release_orphan(key, dst_segment_id)
        return Refusal(Reason.NOT_FOUND, f"no move of {key} to {dst_segment_id}")
    return obj


def move_done(b: Book, key: str, dst_segment_id: str, now: float) -> Ok | Refusal:
    obj = _moving(b, key, dst_segment_id)
    if isinstance(obj, Refusal):
        return obj
    mv = obj.move
    assert mv is not None
    b.end_move(obj)
    b.attach(obj, replace(mv.dst, state=ReplicaState.COMPLETE))
    src = next((r for r in obj.replicas if r.segment_id == mv.src.segment_id), None)
    if src is not None:
        b.detach(obj, src)
        if obj.lease_until > now:  # a reader may hold its address: free it later
            seg = b.segments[src.segment_id]
            b.hold(seg, key, src, obj.lease_until, orphan=False)
        else:
            b.free(src)
        reason: DropReason = "evicted" if mv.offload else "moved"
        keeps = any(r.node_id == src.node_id for r in obj.replicas)
        b.changes.append(ReplicaDropped(key, src, reason, keeps))
    b.stats["offloaded" if mv.offload else "promoted"] += 1
    b.stored(obj)
    return OK


def move_failed(b: Book, key: str, dst_segment_id: str, now: float) -> Ok | Refusal:
    obj = _moving(b, key, dst_segment_id)
    if isinstance(obj, Refusal):
        return obj
    fail_move(b, obj, now)
    return OK


def fail_move(b: Book, obj: _Obj, now: float) -> None:
    mv = b.cancel_move(obj)
    src = next((r for r in obj.replicas if r.segment_id == mv.src.segment_id), None)
    # A failed offload was an eviction: finish it by dropping the source, unless a reader
    # leased the object meanwhile (then it simply stays in DRAM).
    if mv.offload and src is not None and obj.lease_until <= now:
        b.drop_replicas(obj, [src], "evicted", now)


def promote(b: Book, obj: _Obj, now: float) -> None:
    src = obj.replicas[0]
    node = b.nodes.get(src.node_id)
    if node is None:
        return
    need = b.aligned(obj.size)
    dram = [
        s for sid in sorted(node.segments)
        if (s := b.segments[sid]).info.tier is Tier.DRAM and s.info.size >= need
    ]  # fmt: skip
    # A promotion is a DRAM allocation of the owner like a put: within its quota, or none.
    quota = quota_room(b, obj.owner, Tier.DRAM, need, now, exclude=obj.key) if dram else None
    if not isinstance(quota, Ok):
        return
    seg = _room_on(b, dram, need, now, exclude=obj.key, wait_for_moves=True)
    # Making room offloads other objects to the SSD, which may have evicted this one there.
    if seg is not None and b.objects.get(obj.key) is obj and src in obj.replicas:
        b.start_move(obj, src, b.alloc(seg, obj.size), now)

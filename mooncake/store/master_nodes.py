"""Segments and nodes: mount, heartbeat, node expiry, and restore (adopting reported replicas).

Functions of the master's `Book`. PURE, like the rest of the master state; semantics:
`master_state`'s module docstring.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from mooncake.store.master_book import Book
from mooncake.store.master_records import _Node, _Obj, _Segment
from mooncake.store.master_types import OK, Ok, Refusal, Restored
from mooncake.store.types import Reason, Replica, ReplicaState, ReportedObject, SegmentInfo

__all__ = ["expire", "heartbeat", "mount", "restore"]


def mount(b: Book, info: SegmentInfo, now: float) -> Ok | Refusal:
    if not info.segment_id or not info.node_id or info.size <= 0:
        return Refusal(Reason.INVALID, f"bad segment {info.segment_id!r} size {info.size}")
    seg = b.segments.get(info.segment_id)
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
        b.segments[info.segment_id] = _Segment(info, b.config.alignment)
    node = b.nodes.get(info.node_id)
    if node is None:
        node = b.nodes[info.node_id] = _Node(info.node_id, now)
    node.last_seen = max(node.last_seen, now)
    node.segments.add(info.segment_id)
    return OK


def heartbeat(b: Book, node_id: str, now: float) -> Ok | Refusal:
    node = b.nodes.get(node_id)
    if node is None:  # never mounted, timed out, or the master restarted: re-mount
        return Refusal(Reason.UNKNOWN_NODE, node_id)
    node.last_seen = max(node.last_seen, now)
    return OK


def restore(
    b: Book,
    node_id: str,
    segments: Sequence[SegmentInfo],
    objects: Iterable[ReportedObject],
    now: float,
) -> Restored | Refusal:
    """A node (re-)mounts and reports the objects whose bytes it holds: adopt them as
    COMPLETE replicas at exactly those ranges. Its report is the truth for its segments: a
    complete replica there that it does not report is gone (a node killed and started again
    before it timed out comes back with empty segments under the same ids), and is dropped
    as lost, so no reader is sent to bytes that are not there."""
    if any(s.node_id != node_id for s in segments):
        return Refusal(Reason.INVALID, f"a segment of another node in {node_id}'s mount")
    mounted = {s.segment_id for s in segments if isinstance(mount(b, s, now), Ok)}
    objects = list(objects)
    _drop_unreported(b, mounted, {(o.key, o.segment_id) for o in objects}, now)
    adopted = rejected = 0
    changed: dict[str, _Obj] = {}
    for rep in objects:
        verdict = _adopt(b, rep, now) if rep.segment_id in mounted else None
        if verdict is None:
            rejected += 1
        else:
            adopted += 1
            changed[verdict.key] = verdict
    for obj in changed.values():
        b.stored(obj)
    b.stats["restore_adopted"] += adopted
    b.stats["restore_rejected"] += rejected
    return Restored(adopted, rejected)


def _drop_unreported(
    b: Book, mounted: set[str], reported: set[tuple[str, str]], now: float
) -> None:
    """Drop the complete replicas on `mounted` segments that the node did not report."""
    for sid in sorted(mounted):
        for key in sorted(b.segments[sid].keys):
            obj = b.objects.get(key)
            if obj is None or not obj.complete:
                continue  # a put in flight: its own timeout or put_end settles it
            gone = [
                r for r in obj.replicas
                if r.segment_id == sid and r.state is ReplicaState.COMPLETE
                and (key, sid) not in reported
            ]  # fmt: skip
            if not gone:
                continue
            mv = obj.move
            if mv is not None and sid in (mv.src.segment_id, mv.dst.segment_id):
                b.cancel_move(obj)
                gone = [r for r in gone if r in obj.replicas]
            b.drop_replicas(obj, gone, "node_lost", now)
            b.stats["restore_dropped"] += 1


def _adopt(b: Book, rep: ReportedObject, now: float) -> _Obj | None:
    """The object now holding the reported replica (adopted now, or already known exactly
    as reported: a node re-mounting to a master that never lost it), None if rejected."""
    seg = b.segments[rep.segment_id]
    obj = b.objects.get(rep.key)
    if obj is not None:
        same = [r for r in obj.replicas if r.segment_id == rep.segment_id]
        if obj.complete and same and same[0].offset == rep.offset and obj.size == rep.size:
            return obj
        if not obj.complete or same or obj.size != rep.size:
            return None
    if obj is None and len(b.objects) >= b.config.max_objects:
        return None  # the table is full: rejected (the node forgets it at its resync)
    if not rep.key or rep.size <= 0 or not seg.alloc.reserve(rep.offset, rep.size):
        return None
    if obj is None:
        obj = _Obj(rep.key, rep.size, rep.pin, now, [], rep.owner, complete=True, last_access=now)
        b.objects[rep.key] = obj
    info = seg.info
    b.attach(
        obj,
        Replica(
            info.segment_id, info.node_id, info.tier, rep.offset, rep.size,
            ReplicaState.COMPLETE,
        ),
    )  # fmt: skip
    return obj


def expire(b: Book, now: float) -> None:
    """Nodes silent for longer than `node_timeout_s` are lost, with all their segments."""
    for node in [n for n in b.nodes.values() if now - n.last_seen > b.config.node_timeout_s]:
        for sid in sorted(node.segments):
            b.drop_segment(b.segments[sid], now)
        del b.nodes[node.node_id]
        b.stats["nodes_lost"] += 1

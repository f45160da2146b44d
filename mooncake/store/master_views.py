"""Read-only views of the master's `Book`: objects, segments, usage, allocated ranges.

The bodies of `MasterState`'s introspection methods (documented there); nothing here mutates
the book. PURE, like the rest of the master state; semantics:
`master_state`'s module docstring.
"""

from __future__ import annotations

from mooncake.store.master_book import Book
from mooncake.store.master_types import Move, ObjectView, SegmentStatus
from mooncake.store.types import Pin, Replica, Tier

__all__ = [
    "node_objects",
    "object_view",
    "ranges",
    "segment_statuses",
    "usage",
    "usage_by_owner",
]


def object_view(b: Book, key: str) -> ObjectView | None:
    obj = b.objects.get(key)
    if obj is None:
        return None
    mv = obj.move
    return ObjectView(
        obj.key, obj.owner, obj.size, obj.pin, obj.complete, tuple(obj.replicas), obj.lease_until,
        obj.last_access, None if mv is None else Move(obj.key, mv.src, mv.dst),
    )  # fmt: skip


def segment_statuses(b: Book) -> list[SegmentStatus]:
    return [
        SegmentStatus(s.info, s.alloc.used, s.alloc.largest_free, s.pending_free)
        for s in b.segments.values()
    ]


def node_objects(b: Book, node_id: str) -> list[tuple[str, Replica, Pin, str]]:
    node = b.nodes.get(node_id)
    out: list[tuple[str, Replica, Pin, str]] = []
    for sid in sorted(node.segments) if node else ():
        for key in sorted(b.segments[sid].keys):
            obj = b.objects[key]
            if obj.complete:
                out += [(key, r, obj.pin, obj.owner) for r in obj.replicas if r.segment_id == sid]
    return out


def usage(b: Book) -> dict[str, dict[str, int]]:
    out = {t.value: {"capacity": 0, "used": 0, "pending_free": 0, "segments": 0} for t in Tier}
    for s in b.segments.values():
        u = out[s.info.tier.value]
        u["capacity"] += s.info.size
        u["used"] += s.alloc.used
        u["pending_free"] += s.pending_free
        u["segments"] += 1
    return out


def usage_by_owner(b: Book) -> dict[str, dict[str, int]]:
    return {
        owner: {t.value: n for t, n in acct.used.items()}
        for owner, acct in sorted(b.accounts.items())
    }


def ranges(b: Book) -> dict[str, list[tuple[int, int, str]]]:
    out: dict[str, list[tuple[int, int, str]]] = {sid: [] for sid in b.segments}
    for obj in b.objects.values():
        for r in obj.replicas:
            out[r.segment_id].append((r.offset, b.aligned(r.size), obj.key))
    for moving in b.moving.values():
        if moving.move is not None:
            d = moving.move.dst
            out[d.segment_id].append((d.offset, b.aligned(d.size), moving.key + ">move"))
    for h in b.held:
        out[h.seg.info.segment_id].append((h.offset, h.length, h.key + "~held"))
    for lst in out.values():
        lst.sort()
    return out

"""The store master's internal records: per-object, per-segment and per-node bookkeeping.

Package-private to the `master_*` modules (hence the leading underscores): mutable, never
handed to callers, who see the frozen values of `master_types`. Semantics: `master_state`'s
module docstring.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field

from mooncake.store.allocator import Allocator
from mooncake.store.types import Pin, Replica, SegmentInfo, Tier

_NEVER = float("-inf")


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
    owner: str  # the cache namespace its bytes are accounted to
    complete: bool = False
    lease_until: float = _NEVER
    last_access: float = 0.0
    move: _Move | None = None


class _Account:
    """One owner's bytes per tier (aligned: its replicas, pending or complete, and its moves'
    destinations in flight) and its objects per tier in LRU order (complete replicas; like
    the tier LRUs, hard-pinned objects are never in them). No bytes left: no objects either,
    and the account is dropped."""

    __slots__ = ("lru", "used")

    def __init__(self) -> None:
        self.used = dict.fromkeys(Tier, 0)
        self.lru = {t: _Lru() for t in Tier}


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

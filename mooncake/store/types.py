"""Values shared by the store's master, nodes, clients and transports.

A *segment* is one contiguous memory region owned by a node (DRAM, or an SSD tier file mapped
into memory); the master allocates byte ranges inside segments and never touches bytes. An
object (a KV block, but the store is generic bytes) has one or more *replicas*, each a range in
a distinct segment. Addresses a client needs to reach a segment are in `SegmentInfo.endpoints`,
one per transport name (`{"tcp": "127.0.0.1:7001", "shm": "/mc-node1-dram-3f2a"}`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from mooncake.hashing import DEFAULT_CACHE_NAMESPACE


class Tier(StrEnum):
    DRAM = "dram"
    SSD = "ssd"


class Pin(StrEnum):
    """NONE: evictable in LRU order. SOFT: evicted only when nothing unpinned is left.
    HARD: never evicted (removed only by an explicit remove)."""

    NONE = "none"
    SOFT = "soft"
    HARD = "hard"


class ReplicaState(StrEnum):
    PENDING = "pending"  # allocated, bytes being written: invisible to readers
    COMPLETE = "complete"


class Placement(StrEnum):
    RANDOM = "random"
    MOST_FREE = "most_free"


class Reason(StrEnum):
    """Why the master refused an operation (a return value, never an exception)."""

    NOT_FOUND = "not_found"
    EXISTS = "exists"  # put_start of a key that is already stored or being put
    NO_SPACE = "no_space"  # no segment (set) can hold it, even after eviction
    NOT_ENOUGH_SEGMENTS = "not_enough_segments"  # fewer live segments than replicas asked
    LEASED = "leased"  # remove refused while a read lease is held
    NOT_PENDING = "not_pending"  # put_end / revoke of a key that is not being put
    UNKNOWN_SEGMENT = "unknown_segment"
    UNKNOWN_NODE = "unknown_node"
    INVALID = "invalid"  # bad size, key, replica count ...
    RETRY_LATER = "retry_later"  # room is being made (an offload is in flight): try again soon
    # The owner's namespace quota is full and its own evictable objects cannot make room
    # (leased, pending or hard-pinned): other owners' objects are never evicted for it.
    QUOTA = "quota"


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    segment_id: str  # globally unique, e.g. "node1-dram-0"
    node_id: str
    tier: Tier
    size: int
    endpoints: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Replica:
    segment_id: str
    node_id: str
    tier: Tier
    offset: int
    size: int
    state: ReplicaState = ReplicaState.PENDING


@dataclass(frozen=True, slots=True)
class Region:
    """A byte range inside one segment: what a transport reads or writes."""

    segment_id: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class ReportedObject:
    """An object whose bytes a node holds, reported when it re-mounts after a master restart."""

    key: str
    segment_id: str
    offset: int
    size: int
    pin: Pin = Pin.NONE
    owner: str = DEFAULT_CACHE_NAMESPACE  # the cache namespace its bytes are accounted to

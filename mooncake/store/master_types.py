"""The store master's public values: its config, results, changes and introspection views.

Pure data, no behaviour beyond validation; the semantics they carry are documented once, in
`master_state`'s module docstring. Import them from `mooncake.store.master_state`, which
re-exports every name here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from mooncake.hashing import DEFAULT_CACHE_NAMESPACE
from mooncake.store.types import Pin, Reason, Replica, SegmentInfo, Tier

__all__ = [
    "DEFAULT_OWNER",
    "OK",
    "Change",
    "DropReason",
    "Lookup",
    "MasterConfig",
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
    "Restored",
    "SegmentStatus",
]


# Whom an object's bytes are accounted to when its put names no one: the default tenant's own
# cache namespace (`hashing.cache_namespace`), where the default tenant's blocks are keyed.
DEFAULT_OWNER = DEFAULT_CACHE_NAMESPACE


@dataclass(frozen=True, slots=True)
class Quota:
    """Caps on one owner's bytes per tier (None: no cap). What counts: the aligned bytes of its
    objects' replicas in that tier, pending and complete, and of its moves' destinations in
    flight."""

    dram_bytes: int | None = None
    ssd_bytes: int | None = None

    def cap(self, tier: Tier) -> int | None:
        return self.dram_bytes if tier is Tier.DRAM else self.ssd_bytes


@dataclass(frozen=True)
class MasterConfig:
    lease_s: float = 10.0  # read lease granted by a lookup; blocks remove and eviction
    high_watermark: float = 0.90  # evict when DRAM usage (over all DRAM segments) exceeds this
    evict_fraction: float = 0.05  # ... freeing this share of capacity (approx LRU)
    put_timeout_s: float = 30.0  # a pending put (or move) older than this is a zombie
    node_timeout_s: float = 10.0  # no heartbeat for this long: node dead, its replicas dropped
    alignment: int = 64
    # The most objects in the table, pending puts included: what bounds the master's memory
    # (capacity alone does not: 64-byte objects are ~1000x more entries than 64 KiB ones).
    max_objects: int = 1_000_000
    # Per owner (the cache namespace a put names); `default_quota` caps the owners not named
    # (None: they are unlimited).
    quotas: Mapping[str, Quota] = field(default_factory=dict, hash=False)
    default_quota: Quota | None = None

    def cap(self, owner: str, tier: Tier) -> int | None:
        """The most bytes `owner` may hold in `tier` (None: no cap)."""
        quota = self.quotas.get(owner, self.default_quota)
        return None if quota is None else quota.cap(tier)

    def __post_init__(self) -> None:
        if not 0.0 < self.high_watermark <= 1.0 or not 0.0 <= self.evict_fraction < 1.0:
            raise ValueError("high_watermark must be in (0, 1], evict_fraction in [0, 1)")
        if self.lease_s < 0 or self.put_timeout_s <= 0 or self.node_timeout_s <= 0:
            raise ValueError("lease_s >= 0, put_timeout_s > 0 and node_timeout_s > 0")
        if self.alignment <= 0 or self.max_objects < 1:
            raise ValueError("alignment and max_objects must be positive")
        for q in [*self.quotas.values(), self.default_quota]:
            if q is not None and any(c is not None and c < 0 for c in (q.dram_bytes, q.ssd_bytes)):
                raise ValueError("quota bytes must be >= 0")


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
    owner: str
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

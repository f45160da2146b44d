"""The store's control plane on the wire: NATS request/reply between clients, nodes and the
master. Every message is a frozen pydantic model validated once where it arrives; a request
that does not validate gets an `ErrorReply`, never a crash.

Subjects (canonical, namespaced like everything else, see `subjects`):
- `mc.store.<op>`: the master (mount, heartbeat, put_start, put_end, put_revoke, put_renew,
  lookup, exists, remove, node_objects);
- `mc.store.node.<node>.move`: the master asks a node to copy an object between two of its
  own segments (SSD offload on eviction, promotion on hit);
- `mc.store.node.<node>.changes`: the master tells a node which objects its segments hold now
  (per-node sequence numbers; a gap makes the node fetch `node_objects`);
- `mc.store.hello`: a master that (re)starts asks every node to mount again;
- `mc.kv.events.<node>` / `mc.kv.snapshot.<node>`: a node's KV index events and snapshots.
- `mc.kv.index.state`: the Conductor's view of every node's KV index (exact, resyncing,
  degraded, since when), for `mooncake up`'s status table and benches.

Every op is a batch (`keys` / `items`); the single forms are batches of one.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from mooncake.namespace import Namespace
from mooncake.store.kv_index import IndexState
from mooncake.store.types import Pin, Placement, Reason, Replica, ReplicaState, SegmentInfo, Tier

MAX_BATCH = 10_000
Key = Annotated[str, Field(min_length=1, max_length=256)]
NodeId = Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
SegmentId = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,128}$")]
Size = Annotated[int, Field(ge=0, le=1 << 50)]
# Whom an object's bytes are accounted to: a cache namespace (`hashing.cache_namespace`);
# None: the default tenant's (`master_state.DEFAULT_OWNER`).
Owner = Annotated[str, Field(min_length=1, max_length=128)]

MASTER_OPS = (
    "mount",
    "heartbeat",
    "put_start",
    "put_end",
    "put_revoke",
    "put_renew",
    "lookup",
    "exists",
    "remove",
    "node_objects",
)


class Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SegmentWire(Wire):
    segment_id: SegmentId
    node_id: NodeId
    tier: Tier
    size: Annotated[int, Field(gt=0, le=1 << 50)]
    endpoints: dict[str, Annotated[str, Field(max_length=512)]] = {}

    @classmethod
    def of(cls, info: SegmentInfo) -> SegmentWire:
        return cls(
            segment_id=info.segment_id,
            node_id=info.node_id,
            tier=info.tier,
            size=info.size,
            endpoints=dict(info.endpoints),
        )

    def info(self) -> SegmentInfo:
        return SegmentInfo(self.segment_id, self.node_id, self.tier, self.size, self.endpoints)


class ReplicaWire(Wire):
    segment_id: SegmentId
    node_id: NodeId
    tier: Tier
    offset: Size
    size: Size
    state: ReplicaState = ReplicaState.COMPLETE

    @classmethod
    def of(cls, r: Replica) -> ReplicaWire:
        return cls(
            segment_id=r.segment_id,
            node_id=r.node_id,
            tier=r.tier,
            offset=r.offset,
            size=r.size,
            state=r.state,
        )

    def replica(self) -> Replica:
        return Replica(self.segment_id, self.node_id, self.tier, self.offset, self.size, self.state)


class HeldObject(Wire):
    """One object a node holds: what it reports on (re-)mount and what `changes` carry."""

    key: Key
    segment_id: SegmentId
    offset: Size
    size: Size
    pin: Pin = Pin.NONE
    owner: Owner | None = None


class Refused(Wire):
    reason: Reason
    detail: Annotated[str, Field(max_length=500)] = ""


class ErrorReply(Wire):
    """The request itself was unreadable (bad JSON, wrong fields, batch too large)."""

    error: Annotated[str, Field(max_length=2000)]


# --- master requests ---------------------------------------------------------------------


class MountRequest(Wire):
    node_id: NodeId
    segments: Annotated[list[SegmentWire], Field(min_length=1, max_length=64)]
    # Objects whose bytes the node still holds: after a master restart they are adopted.
    objects: Annotated[list[HeldObject], Field(max_length=10_000_000)] = []


class MountReply(Wire):
    refused: list[Refused] = []
    adopted: int = 0
    rejected: int = 0


class HeartbeatRequest(Wire):
    node_id: NodeId


class OkReply(Wire):
    refused: Refused | None = None


class PutItem(Wire):
    key: Key
    size: Annotated[int, Field(gt=0, le=1 << 40)]
    replicas: Annotated[int, Field(ge=1, le=16)] = 1
    pin: Pin = Pin.NONE
    preferred_segment: SegmentId | None = None
    placement: Placement = Placement.MOST_FREE
    owner: Owner | None = None  # counts against this namespace's quota


class PutStartRequest(Wire):
    items: Annotated[list[PutItem], Field(min_length=1, max_length=MAX_BATCH)]


class Plan(Wire):
    replicas: list[ReplicaWire]


class SegmentsMixin(Wire):
    # Endpoints of every segment the reply's replicas live in (one entry per segment).
    segments: dict[str, dict[str, str]] = {}


class PutStartReply(SegmentsMixin):
    results: list[Plan | Refused]


class SharedPut(SegmentsMixin):
    """Where the objects of a started put live, for another process to write pieces of them
    (`StoreClient.join_put`): a chunked-pipeline stage writes its layers of each KV block the
    group's leader allocated, and the leader alone commits. Each joiner picks its own
    transports from the segments' endpoints."""

    plans: Annotated[dict[Key, Plan], Field(max_length=MAX_BATCH)]


class KeysRequest(Wire):
    keys: Annotated[list[Key], Field(min_length=1, max_length=MAX_BATCH)]
    force: bool = False  # remove only: ignore read leases


class ResultsReply(Wire):
    results: list[Refused | None]  # None = done


class Found(Wire):
    replicas: list[ReplicaWire]
    lease_s: float


class LookupReply(SegmentsMixin):
    results: list[Found | Refused]


class ExistsReply(Wire):
    results: list[bool]


class NodeObjectsRequest(Wire):
    node_id: NodeId


class NodeObjects(Wire):
    seq: int
    objects: list[HeldObject]


# --- master -> node ----------------------------------------------------------------------


class MoveRequest(Wire):
    key: Key
    src: ReplicaWire
    dst: ReplicaWire


class NodeUpdate(Wire):
    """The node's copies of `key` are now exactly `held` (empty: it holds none)."""

    key: Key
    held: list[HeldObject] = []


class NodeChanges(Wire):
    """Updates to what a node's segments hold, in master order (`seq` counts per node)."""

    seq: Annotated[int, Field(ge=1)]
    updates: list[NodeUpdate]


# --- KV index events (node -> everyone) ----------------------------------------------------


class KvEvents(Wire):
    node_id: NodeId
    seq: Annotated[int, Field(ge=0)]  # a batch's is >= 1; a tip's is 0 before any batch
    # A node process's life: a restarted node starts again at seq 1 under a new epoch.
    epoch: Annotated[str, Field(max_length=64)] = ""
    stored: list[Key] = []
    removed: list[Key] = []
    # Tier changes (store/kv_index.py): now only on the node's SSD / back in its DRAM.
    ssd: list[Key] = []
    dram: list[Key] = []
    # A tip: no changes; `seq` is the producer's last batch (store/kv_index.py `KvTip`).
    tip: bool = False

    @model_validator(mode="after")
    def _batch_seq(self) -> KvEvents:
        if not self.tip and self.seq < 1:
            raise ValueError("a batch's seq starts at 1")
        return self


class KvSnapshotWire(Wire):
    node_id: NodeId
    seq: Annotated[int, Field(ge=0)]
    epoch: Annotated[str, Field(max_length=64)] = ""
    keys: list[Key]
    ssd: list[Key] = []  # of `keys`, those held only on SSD


class KvIndexNodeState(Wire):
    """One node's KV index as the Conductor follows it: its state, and since when."""

    node_id: NodeId
    state: IndexState
    since: float  # unix seconds (the Conductor's clock) when it entered `state`


class KvIndexReport(Wire):
    """The Conductor's answer on `mc.kv.index.state`: every KV index it follows, store
    nodes (their pools) and engines (each instance's own pool), as of `at`."""

    at: float  # unix seconds (the Conductor's clock): age in a state = at - since
    nodes: list[KvIndexNodeState] = []
    engines: list[KvIndexNodeState] = []


class Subjects:
    """Namespaced subjects of the store."""

    def __init__(self, ns: Namespace) -> None:
        self.ns = ns

    def master(self, op: str) -> str:
        return self.ns.subject(f"mc.store.{op}")

    def master_all(self) -> str:
        return self.ns.subject("mc.store.*")

    def master_hello(self) -> str:
        """A master that (re)starts says so: every node mounts again at once, instead of at
        its next heartbeat, so the master knows their objects sooner."""
        return self.ns.subject("mc.store.hello")

    def node(self, node_id: str, what: Literal["move", "changes"]) -> str:
        return self.ns.subject(f"mc.store.node.{node_id}.{what}")

    def kv_events(self, node_id: str = "*") -> str:
        return self.ns.subject(f"mc.kv.events.{node_id}")

    def kv_snapshot(self, node_id: str) -> str:
        return self.ns.subject(f"mc.kv.snapshot.{node_id}")

    def engine_kv_events(self, instance: str = "*") -> str:
        """An engine's KV pool announcing the prompt blocks it caches (its engine tier)."""
        return self.ns.subject(f"mc.kv.engine.{instance}")

    def engine_kv_snapshot(self, instance: str) -> str:
        return self.ns.subject(f"mc.kv.engine.{instance}.snapshot")

    def kv_index_state(self) -> str:
        """The Conductor answers what it knows of every node's KV index (`KvIndexReport`)."""
        return self.ns.subject("mc.kv.index.state")

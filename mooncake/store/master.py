"""The store master as a NATS service: request/reply around the pure `MasterState`.

The state is authoritative in memory; every change leaves the process three ways:
- the journal: `kv.object.stored` / `kv.object.removed` events on JetStream (batched, off the
  reply path), folded into the `kv_objects` projection by the recorder; at most `journal_max`
  wait for JetStream, the oldest dropped past it (`JOURNAL_LOSS`: what the record loses);
- node notifications (`NodeChanges`, per-node sequence numbers) so each node knows what its
  segments hold: it reports that on re-mount after a master restart, and publishes it as KV
  index events;
- `Move` commands to a node (SSD offload on eviction, promotion on hit), whose outcome comes
  back as `move_done` / `move_failed`.

A restarted master knows nothing: nodes learn it from their next heartbeat (UNKNOWN_NODE),
re-mount, and report the objects whose bytes they still hold, which are adopted again.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import random
import time
import uuid
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pydantic import BaseModel, ValidationError

from mooncake import events as ev
from mooncake import metrics
from mooncake.aio import cancel_all
from mooncake.bus.publish import Publisher
from mooncake.config import NamespaceQuota, StoreSettings
from mooncake.store import master_state as ms
from mooncake.store import protocol as p
from mooncake.store.types import Reason, Replica, ReplicaState

log = logging.getLogger("mooncake.store.master")

Clock = Callable[[], float]


def master_config(s: StoreSettings) -> ms.MasterConfig:
    default = s.default_namespace_quota
    return ms.MasterConfig(
        lease_s=s.lease_s,
        high_watermark=s.high_watermark,
        evict_fraction=s.evict_fraction,
        put_timeout_s=s.put_timeout_s,
        node_timeout_s=s.node_timeout_s,
        max_objects=s.max_objects,
        quotas={ns: _quota(q) for ns, q in s.namespace_quotas.items()},
        default_quota=None if default is None else _quota(default),
    )


def _quota(q: NamespaceQuota) -> ms.Quota:
    return ms.Quota(dram_bytes=q.dram_bytes, ssd_bytes=q.ssd_bytes)


# Namespaces with a label of their own in `mc_store_namespace_bytes`, besides those with a
# quota (the first seen; the rest are "_other": `metrics.TenantLabels`).
NAMESPACE_LABELS = 32


def _refused(r: ms.Refusal) -> p.Refused:
    return p.Refused(reason=r.reason, detail=r.detail[:500])


def _journal_replica(r: Replica) -> ev.Replica:
    # pydantic's Rust-side validation is faster than its pure-Python model_construct for
    # these small models (measured: put_end -40 %), so every model here is built normally.
    return ev.Replica(node=r.node_id, segment=r.segment_id, tier=r.tier.value)


class StoreMaster:
    def __init__(
        self,
        nc: NATS,
        ns: ev.Namespace,
        state: ms.MasterState,
        *,
        publisher: Publisher | None = None,
        clock: Clock = time.monotonic,
        tick_s: float = 0.1,
        move_timeout_s: float = 10.0,
        dispatch_delay_s: float = 0.002,
        namespace_labels: metrics.TenantLabels | None = None,
        journal_max: int = 100_000,
    ) -> None:
        self.nc, self.state, self.publisher = nc, state, publisher
        self.namespace_labels = namespace_labels or metrics.TenantLabels(
            state.config.quotas, NAMESPACE_LABELS
        )
        self._namespace_series: set[tuple[str, str]] = set()
        self.subjects = p.Subjects(ns)
        self.clock, self.tick_s, self.move_timeout_s = clock, tick_s, move_timeout_s
        self.dispatch_delay_s = dispatch_delay_s
        self._dispatch_handle: asyncio.TimerHandle | None = None
        self._subs: list[Subscription] = []
        self._tasks: set[asyncio.Task[None]] = set()
        # Per mounted node: the seq of its last NodeChanges (pruned when the node is lost).
        self._node_seq: dict[str, int] = {}
        # Events JetStream has not taken yet, at most `journal_max` (`_journal_add`).
        self._journal: deque[ev.Event] = deque()
        self.journal_max = journal_max
        self._journal_dropped = 0  # ever (the flush counts what left the head meanwhile)
        self._outage_dropped = 0  # since the journal last emptied
        self._flush_lock = asyncio.Lock()
        # Journal event ids: a random prefix per master process, then a counter (unique, and
        # cheaper than a uuid4 per event, which reads the OS's random source each time).
        self._id_prefix = f"sm-{uuid.uuid4().hex[:20]}-"
        self._id_counter = itertools.count(1)
        self._journal_ready = asyncio.Event()
        # A handler answers with a model, or with its JSON already made (the hot ops build
        # it from plain dicts: a third of the cost; `test_master_fast_json` checks it parses
        # as the reply model says).
        self._handlers: dict[str, Callable[[bytes], BaseModel | bytes]] = {
            "mount": self._mount,
            "heartbeat": self._heartbeat,
            "put_start": self._put_start,
            "put_end": self._put_end,
            "put_revoke": self._put_revoke,
            "put_renew": self._put_renew,
            "lookup": self._lookup,
            "exists": self._exists,
            "remove": self._remove,
            "node_objects": self._node_objects,
        }

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        for op in p.MASTER_OPS:
            self._subs.append(await self.nc.subscribe(self.subjects.master(op), cb=self._serve))
        self._spawn(self._tick_loop())
        if self.publisher is not None:
            self._spawn(self._journal_loop())
        await self.nc.flush()
        # Nodes of an earlier life of this master mount again now (they hold the objects).
        await self._notify(self.subjects.master_hello(), p.OkReply())
        log.info("store master up")

    async def stop(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs.clear()
        if self._dispatch_handle is not None:
            self._dispatch_handle.cancel()
            self._dispatch_due()
        await self._flush_journal()
        if self._outage_dropped:
            log.warning(
                "stopping with %d journal event(s) unpublished and %d dropped (%s)",
                len(self._journal),
                self._outage_dropped,
                JOURNAL_LOSS,
            )
        await cancel_all(list(self._tasks))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- request dispatch -----------------------------------------------------------------

    async def _serve(self, msg: Msg) -> None:
        op = msg.subject.rsplit(".", 1)[-1]
        handler = self._handlers.get(op)
        try:
            reply: BaseModel | bytes = (
                handler(msg.data) if handler else p.ErrorReply(error=f"unknown op {op!r}")
            )
        except ValidationError as e:
            reply = p.ErrorReply(
                error=f"invalid {op} request: {e.error_count()} error(s): "[:200]
                + str(e.errors(include_url=False, include_input=False))[:1500]
            )
        except Exception as e:  # a bug must not take the master down
            log.exception("store master: %s failed", op)
            reply = p.ErrorReply(error=f"{op} failed: {type(e).__name__}")
        if msg.reply:  # answer first: the journal and notifications are not on its path
            with contextlib.suppress(Exception):
                await msg.respond(
                    reply if isinstance(reply, bytes) else reply.model_dump_json().encode()
                )
            # `respond` only buffers the answer; yield so the NATS client's flusher writes
            # it now, not after the next queued request (a pipelined client sends several).
            await asyncio.sleep(0)
        self._dispatch_soon()

    def _dispatch_soon(self) -> None:
        """Journal events and node updates for what the requests changed, a moment later.

        `respond` only buffers an answer (the NATS client's flusher writes it at its next
        turn), and building the journal and the node updates costs ~15 µs per object: done
        at once, it would delay the answer, and the client's next request (a client that put
        a batch reads it next). Deferred by `dispatch_delay_s`, it runs while the client moves
        bytes, and one pass covers every request of that moment. A timer, so it cannot
        starve: it fires however busy the master is."""
        if self._dispatch_handle is None:
            loop = asyncio.get_running_loop()
            self._dispatch_handle = loop.call_later(self.dispatch_delay_s, self._dispatch_due)

    def _dispatch_due(self) -> None:
        self._dispatch_handle = None
        try:
            self._dispatch_changes()
        except Exception:  # the changes stay drained; the record is rebuilt from the nodes
            log.exception("store master: dispatching changes failed")

    def _endpoints_of(self, segment_ids: Iterable[str]) -> dict[str, dict[str, str]]:
        out: dict[str, dict[str, str]] = {}
        for sid in segment_ids:
            info = self.state.segment(sid)
            out[sid] = dict(info.endpoints) if info else {}
        return out

    # --- ops ----------------------------------------------------------------------------------

    def _mount(self, data: bytes) -> p.MountReply:
        req = p.MountRequest.model_validate_json(data)
        now = self.clock()
        bad = [s for s in req.segments if s.node_id != req.node_id]
        if bad:
            return p.MountReply(
                refused=[p.Refused(reason=Reason.INVALID, detail="segment of another node")]
            )
        objects = [
            ms.ReportedObject(
                o.key, o.segment_id, o.offset, o.size, o.pin, o.owner or ms.DEFAULT_OWNER
            )
            for o in req.objects
        ]
        res = self.state.restore(req.node_id, [s.info() for s in req.segments], objects, now)
        if isinstance(res, ms.Refusal):
            return p.MountReply(refused=[_refused(res)])
        # The node's view now equals the master's: restart its change sequence.
        self._node_seq[req.node_id] = 0
        log.info(
            "node %s mounted %d segment(s); adopted %d object(s), rejected %d",
            req.node_id,
            len(req.segments),
            res.adopted,
            res.rejected,
        )
        return p.MountReply(adopted=res.adopted, rejected=res.rejected)

    def _heartbeat(self, data: bytes) -> p.OkReply:
        req = p.HeartbeatRequest.model_validate_json(data)
        res = self.state.heartbeat(req.node_id, self.clock())
        return p.OkReply(refused=_refused(res) if isinstance(res, ms.Refusal) else None)

    def _put_start(self, data: bytes) -> bytes:
        req = p.PutStartRequest.model_validate_json(data)
        now = self.clock()
        results: list[dict[str, Any]] = []
        segment_ids: set[str] = set()
        for it in req.items:
            res = self.state.put_start(
                it.key,
                it.size,
                now,
                replicas=it.replicas,
                preferred_segment=it.preferred_segment,
                pin=it.pin,
                placement=it.placement,
                owner=it.owner or ms.DEFAULT_OWNER,
            )
            if isinstance(res, ms.Refusal):
                results.append(_refused(res).model_dump(mode="json"))
            else:
                segment_ids.update(r.segment_id for r in res.replicas)
                results.append({"replicas": [replica_json(r) for r in res.replicas]})
        return _json({"segments": self._endpoints_of(segment_ids), "results": results})

    def _keys_op(self, data: bytes, op: Callable[[str, float], Any]) -> p.ResultsReply:
        req = p.KeysRequest.model_validate_json(data)
        now = self.clock()
        out: list[p.Refused | None] = []
        for key in req.keys:
            res = op(key, now)
            out.append(_refused(res) if isinstance(res, ms.Refusal) else None)
        return p.ResultsReply(results=out)

    def _put_end(self, data: bytes) -> p.ResultsReply:
        return self._keys_op(data, self.state.put_end)

    def _put_revoke(self, data: bytes) -> p.ResultsReply:
        return self._keys_op(data, self.state.put_revoke)

    def _put_renew(self, data: bytes) -> p.ResultsReply:
        return self._keys_op(data, self.state.put_renew)

    def _remove(self, data: bytes) -> p.ResultsReply:
        req = p.KeysRequest.model_validate_json(data)
        now = self.clock()
        out: list[p.Refused | None] = []
        for key in req.keys:
            res = self.state.remove(key, now, force=req.force)
            out.append(_refused(res) if isinstance(res, ms.Refusal) else None)
        return p.ResultsReply(results=out)

    def _lookup(self, data: bytes) -> bytes:
        req = p.KeysRequest.model_validate_json(data)
        now = self.clock()
        results: list[dict[str, Any]] = []
        segment_ids: set[str] = set()
        for key in req.keys:
            res = self.state.lookup(key, now)
            if isinstance(res, ms.Refusal):
                results.append(_refused(res).model_dump(mode="json"))
                continue
            segment_ids.update(r.segment_id for r in res.replicas)
            results.append(
                {
                    "replicas": [replica_json(r) for r in res.replicas],
                    "lease_s": max(0.0, res.lease_until - now),
                }
            )
        return _json({"segments": self._endpoints_of(segment_ids), "results": results})

    def _exists(self, data: bytes) -> p.ExistsReply:
        req = p.KeysRequest.model_validate_json(data)
        return p.ExistsReply(results=self.state.exists_many(req.keys))

    def _node_objects(self, data: bytes) -> p.NodeObjects:
        req = p.NodeObjectsRequest.model_validate_json(data)
        held = [
            p.HeldObject(
                key=k, segment_id=r.segment_id, offset=r.offset, size=r.size, pin=pin, owner=owner
            )
            for k, r, pin, owner in self.state.node_objects(req.node_id)
        ]
        return p.NodeObjects(seq=self._node_seq.get(req.node_id, 0), objects=held)

    # --- changes: journal, node notifications, moves ------------------------------------

    def _node_view(self, key: str, node: str) -> p.NodeUpdate:
        obj = self.state.object(key)
        held: list[p.HeldObject] = []
        if obj is not None:
            for r in obj.replicas:
                if r.node_id == node and r.state is ReplicaState.COMPLETE:
                    held.append(
                        p.HeldObject(
                            key=key,
                            segment_id=r.segment_id,
                            offset=r.offset,
                            size=r.size,
                            pin=obj.pin,
                            owner=obj.owner,
                        )
                    )
        return p.NodeUpdate(key=key, held=held)

    def _next_event_id(self) -> str:
        return f"{self._id_prefix}{next(self._id_counter):x}"

    def _dispatch_changes(self) -> None:
        changes = self.state.drain()
        if not changes:
            return
        per_node: dict[str, list[p.NodeUpdate]] = defaultdict(list)
        now = ev.utcnow()
        for c in changes:
            match c:
                case ms.ObjectStored(key=key, size=size, replicas=reps, pin=pin):
                    self._journal_add(
                        ev.KvObjectStored(
                            event_id=self._next_event_id(),
                            occurred_at=now,
                            key=key,
                            size_bytes=size,
                            replicas=[_journal_replica(r) for r in reps],
                            pin=pin.value,
                        )
                    )
                    for node in {r.node_id for r in reps}:
                        per_node[node].append(self._node_view(key, node))
                case ms.ObjectRemoved(key=key, reason=reason, nodes=nodes):
                    metrics.STORE_EVICTIONS.labels(reason).inc()
                    self._journal_add(
                        ev.KvObjectRemoved(
                            event_id=self._next_event_id(), occurred_at=now, key=key, reason=reason
                        )
                    )
                    for node in nodes:
                        per_node[node].append(p.NodeUpdate(key=key, held=[]))
                case ms.ReplicaDropped(key=key, replica=r):
                    per_node[r.node_id].append(self._node_view(key, r.node_id))
                case ms.Move():
                    self._spawn(self._move(c))
        for node, updates in per_node.items():
            seq = self._node_seq[node] = self._node_seq.get(node, 0) + 1
            msg = p.NodeChanges(seq=seq, updates=updates)
            self._spawn(self._notify(self.subjects.node(node, "changes"), msg))
        if self._journal:
            self._journal_ready.set()

    def _prune_node_seq(self) -> None:
        """Forget the change sequence of nodes the state lost (expired): a node that comes
        back mounts again, which restarts it (`_mount`)."""
        known = set(self.state.nodes())
        for node in [n for n in self._node_seq if n not in known]:
            del self._node_seq[node]

    def _journal_add(self, event: ev.Event) -> None:
        """Queue a journal event; the journal full (JetStream not taking events: an outage,
        or slower than the master), the oldest goes. What that costs the record, and what
        mends it, is said in `JOURNAL_LOSS`."""
        if len(self._journal) >= self.journal_max:
            self._journal.popleft()
            self._journal_dropped += 1
            if not self._outage_dropped:
                log.warning(
                    "journal full (store.journal_max=%d events not yet taken by JetStream): "
                    "dropping the oldest; %s",
                    self.journal_max,
                    JOURNAL_LOSS,
                )
            self._outage_dropped += 1
        self._journal.append(event)

    async def _notify(self, subject: str, msg: BaseModel) -> None:
        with contextlib.suppress(Exception):
            await self.nc.publish(subject, msg.model_dump_json().encode())

    async def _move(self, move: ms.Move) -> None:
        req = p.MoveRequest(
            key=move.key, src=p.ReplicaWire.of(move.src), dst=p.ReplicaWire.of(move.dst)
        )
        ok = False
        try:
            resp = await self.nc.request(
                self.subjects.node(move.dst.node_id, "move"),
                req.model_dump_json().encode(),
                timeout=self.move_timeout_s,
            )
            ok = p.OkReply.model_validate_json(resp.data).refused is None
        except Exception as e:
            log.warning("move of %s to %s failed: %s", move.key, move.dst.segment_id, e)
        now = self.clock()
        if ok:
            self.state.move_done(move.key, move.dst.segment_id, now)
        else:
            self.state.move_failed(move.key, move.dst.segment_id, now)
        self._dispatch_changes()

    async def _tick_loop(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            try:
                self._tick()
            except Exception:
                log.exception("store master tick failed")

    def _tick(self) -> None:
        self.state.tick(self.clock())
        self._dispatch_changes()  # a lost node's last changes, before its seq goes
        self._prune_node_seq()
        self._export_usage()

    def _export_usage(self) -> None:
        for tier, u in self.state.usage().items():
            metrics.STORE_USED_BYTES.labels(tier).set(u["used"])
            metrics.STORE_CAPACITY_BYTES.labels(tier).set(u["capacity"])
        metrics.STORE_OBJECTS.set(len(self.state))
        # Summed per label ("_other" gathers many namespaces); a series whose namespaces
        # hold nothing any more reads 0 rather than its last value.
        by_label = dict.fromkeys(self._namespace_series, 0)
        for owner, tiers in self.state.usage_by_owner().items():
            label = self.namespace_labels.label(owner)
            for tier, n in tiers.items():
                by_label[label, tier] = by_label.get((label, tier), 0) + n
        for (label, tier), n in by_label.items():
            metrics.STORE_NAMESPACE_BYTES.labels(label, tier).set(n)
        self._namespace_series = set(by_label)

    async def _flush_journal(self) -> None:
        """Publish the journal in chunks (one acknowledgement each: `publish_many_barrier`),
        yielding between them: a request that arrives meanwhile is answered before the rest
        of the journal is serialised (the journal is off the reply path; it must not delay
        the next reply either). 64 per chunk measured cheaper than 16 for the master and the
        broker (probe A/B: master CPU 8.8 -> 7.8 ms per 192 object ops).

        A chunk leaves the journal once published, so what is queued is all the master
        keeps, within `journal_max` (the events dropped meanwhile left from its head: they
        were the chunk's first)."""
        if self.publisher is None:
            return
        async with self._flush_lock:  # `stop` flushes too: one flusher pops the head
            journal = self._journal
            try:
                while journal:
                    await asyncio.sleep(0)
                    chunk = list(itertools.islice(journal, JOURNAL_CHUNK))
                    dropped = self._journal_dropped
                    await self.publisher.publish_many_barrier(chunk)
                    for _ in range(len(chunk) - (self._journal_dropped - dropped)):
                        journal.popleft()
            except Exception:
                log.exception("journal publish failed; %d event(s) kept for retry", len(journal))
                return
            if self._outage_dropped:
                log.warning(
                    "journal published again; %d event(s) were dropped meanwhile (%s)",
                    self._outage_dropped,
                    JOURNAL_LOSS,
                )
                self._outage_dropped = 0

    async def _journal_loop(self) -> None:
        while True:
            await self._journal_ready.wait()
            self._journal_ready.clear()
            await self._flush_journal()
            if self._journal:  # failed: back off, then retry
                await asyncio.sleep(1.0)
                self._journal_ready.set()


JOURNAL_CHUNK = 64

# What a dropped journal event costs, and what mends it. The journal feeds only the record
# (`kv_objects`, through the recorder); the master's table, the nodes' maps and the
# Conductor's KV index (nodes' KV events, resynced by snapshot) never read it.
JOURNAL_LOSS = (
    "kv_objects misses them: an object whose stored event was dropped gets its row at its "
    "next change (or when a restarted master adopts it again), a removed one keeps a stale "
    "row until its key is stored again; `mooncake db rebuild` cannot mend it (it replays "
    "the events table, which never got them)"
)

# Bytes of master memory per entry, measured with tracemalloc (CPython 3.11, 64-bit; traced
# bytes over the empty master's, divided by the entries held). Objects: puts through the real
# handlers (`_put_start` / `_put_end` from JSON: 32-hex-char block keys, a named owner, sizes
# 64 B to 1 MiB), the table filled to `max_objects` (2e4 and 1e5) and churned by 3x as many
# puts again (each evicting the LRU object for the count limit) with leased reads between
# them: 1066-1189 B steady, 1123-1217 B at the peak; a pool fragmented to a hole next to
# every object (each free range ~250 B more; dicts sized for twice the objects): 1375-1419 B.
# Stated: the worst, rounded up for dict growth steps. A replica more (`replicas=2`, the same
# runs): +475-490 B steady, +800 B fragmented. A journal entry: a `KvObjectStored` built as
# `_dispatch_changes` builds it, its key and timestamp its own (an event may outlive its
# object; a dispatch of one change): 1839 B with one replica at 1e5 entries (1899 B at 2e3),
# 2327 B with two. Keys longer than block keys add their length.
# `test_master_bounds` re-measures a small table and journal against these figures.
MASTER_BYTES_PER_OBJECT = 1600
MASTER_BYTES_PER_EXTRA_REPLICA = 800
MASTER_BYTES_PER_JOURNAL_ENTRY = 2000
MASTER_BYTES_PER_JOURNAL_REPLICA = 500  # each replica past the first


def memory_parts(settings: StoreSettings) -> dict[str, int]:
    """The most bytes the master's bounded tables take, by part: the object table at
    `max_objects` and the journal at `journal_max`, every object with the default replica
    count (`replicas`; a put may ask for more)."""
    more = settings.replicas - 1
    per_object = MASTER_BYTES_PER_OBJECT + more * MASTER_BYTES_PER_EXTRA_REPLICA
    per_entry = MASTER_BYTES_PER_JOURNAL_ENTRY + more * MASTER_BYTES_PER_JOURNAL_REPLICA
    return {
        "objects": settings.max_objects * per_object,
        "journal": settings.journal_max * per_entry,
    }


def replica_json(r: Replica) -> dict[str, Any]:
    """A replica as `protocol.ReplicaWire` serialises it."""
    return {
        "segment_id": r.segment_id,
        "node_id": r.node_id,
        "tier": r.tier.value,
        "offset": r.offset,
        "size": r.size,
        "state": r.state.value,
    }


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def new_state(settings: StoreSettings, seed: int | None = None) -> ms.MasterState:
    return ms.MasterState(master_config(settings), random.Random(seed))

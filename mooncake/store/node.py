"""A store node: owns segments (DRAM in shared memory, pre-touched; optionally an SSD tier file),
serves them through the transfer engine, mounts them with the master and heartbeats.

The node never decides anything about objects: the master allocates, and tells the node
(`NodeChanges`) what its segments hold. The node keeps that map so it can
- report it on re-mount after a master restart (objects whose bytes exist are found again),
- publish KV index events (`mc.kv.events.<node>`, per-node sequence numbers) and answer
  snapshot requests, which feed the Conductor's prefix index,
- copy bytes between its own segments when the master says so (SSD offload / promotion).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from mooncake import metrics
from mooncake.aio import cancel_all
from mooncake.namespace import Namespace
from mooncake.store import protocol as p
from mooncake.store.kv_follow import TIP_EVERY_S, answer_snapshot, batch_bytes, tip_bytes
from mooncake.store.kv_index import KvEventLog
from mooncake.store.segment import Segment, sweep_stale
from mooncake.store.transfer.base import (
    SegmentTable,
    TransferError,
    TransportServer,
    available,
    make_server,
)
from mooncake.store.types import Region, Tier

log = logging.getLogger("mooncake.store.node")


@dataclass(frozen=True)
class NodeConfig:
    node_id: str
    secret: bytes
    dram_bytes: int
    ssd_bytes: int = 0
    ssd_dir: Path | None = None
    transports: tuple[str, ...] = ("rdma", "shm", "tcp")
    tcp_host: str = "127.0.0.1"
    tcp_port: int = 0
    heartbeat_s: float = 1.0
    request_timeout_s: float = 5.0


@dataclass
class NodeStats:
    mounts: int = 0
    moves: int = 0
    change_gaps: int = 0
    kv_batches: int = 0
    extra: dict[str, int] = field(default_factory=dict)


class StoreNode:
    def __init__(self, nc: NATS, ns: Namespace, config: NodeConfig) -> None:
        self.nc, self.config = nc, config
        self.subjects = p.Subjects(ns)
        self.table = SegmentTable()
        self.segments: list[Segment] = []
        self.servers: list[TransportServer] = []
        # key -> {segment_id: HeldObject}: what the master says this node's segments hold.
        self.held: dict[str, dict[str, p.HeldObject]] = {}
        self.kv_log = KvEventLog(config.node_id, epoch=secrets.token_hex(8))
        self.stats = NodeStats()
        self._seq = 0  # last NodeChanges seq applied
        self._subs: list[Subscription] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._resync_lock = asyncio.Lock()
        self._stopping = False
        self._mounted = asyncio.Event()
        self._mount_lock = asyncio.Lock()

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        cfg = self.config
        ssd_dir = cfg.ssd_dir or Path(".mooncake/ssd")
        for directory in (Path("/dev/shm"), ssd_dir):
            for path in sweep_stale(directory):
                log.info("removed %s: left behind by a node that was killed", path)
        self.segments.append(
            Segment.create_dram(f"{cfg.node_id}-dram", cfg.node_id, cfg.dram_bytes)
        )
        if cfg.ssd_bytes > 0:
            ssd_dir.mkdir(parents=True, exist_ok=True)
            self.segments.append(
                Segment.create_ssd(f"{cfg.node_id}-ssd", cfg.node_id, cfg.ssd_bytes, ssd_dir)
            )
        for seg in self.segments:
            self.table.add(seg)
        for name in cfg.transports:
            ok, why = available(name)
            if not ok:
                log.info("transport %s not used: %s", name, why)
                continue
            server = make_server(name, secret=cfg.secret, **self._server_options(name))
            await server.start(self.table)
            self.servers.append(server)
        if not self.servers:
            raise RuntimeError(f"no transport of {cfg.transports} is available here")
        sub = self.subjects
        self._subs += [
            await self.nc.subscribe(sub.node(cfg.node_id, "move"), cb=self._on_move),
            await self.nc.subscribe(sub.node(cfg.node_id, "changes"), cb=self._on_changes),
            await self.nc.subscribe(sub.kv_snapshot(cfg.node_id), cb=self._on_snapshot),
            await self.nc.subscribe(sub.master_hello(), cb=self._on_master_hello),
        ]
        await self.nc.flush()
        self._spawn(self._tip_loop())  # from the start: a new life's tip drops the old one's
        await self._mount()
        self._spawn(self._heartbeat_loop())

    def _server_options(self, name: str) -> dict[str, Any]:
        opts: dict[str, Any] = {}
        if name == "tcp":
            opts |= {"host": self.config.tcp_host, "port": self.config.tcp_port}
        elif name == "rdma":
            opts |= {
                "nc": self.nc,
                "subject_prefix": self.subjects.ns.prefix,
                "node_id": self.config.node_id,
            }
        return opts

    async def stop(self) -> None:
        for s in self._subs:
            with contextlib.suppress(Exception):
                await s.unsubscribe()
        self._stopping = True
        await cancel_all(list(self._tasks))
        for server in self.servers:
            with contextlib.suppress(Exception):
                await server.stop()
        for seg in self.segments:
            self.table.remove(seg.info.segment_id)
            seg.close()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def serve(self, segment: Segment) -> dict[str, str]:
        """Serve a segment of the caller's (a CPP stage's activation inbox) through this
        node's transports, outside the pool (the master never places objects in it): its
        endpoint per transport. The caller `unserve`s and closes it."""
        self.table.add(segment)
        return {s.name: s.endpoint(segment.info.segment_id) for s in self.servers}

    def unserve(self, segment_id: str) -> None:
        self.table.remove(segment_id)

    def segment_infos(self) -> list[p.SegmentWire]:
        out = []
        for seg in self.segments:
            endpoints = {s.name: s.endpoint(seg.info.segment_id) for s in self.servers}
            i = seg.info
            out.append(
                p.SegmentWire(
                    segment_id=i.segment_id,
                    node_id=i.node_id,
                    tier=i.tier,
                    size=i.size,
                    endpoints=endpoints,
                )
            )
        return out

    # --- control plane --------------------------------------------------------------------

    async def _request(self, op: str, msg: p.Wire) -> bytes:
        resp = await self.nc.request(
            self.subjects.master(op),
            msg.model_dump_json().encode(),
            timeout=self.config.request_timeout_s,
        )
        return bytes(resp.data)

    async def _on_master_hello(self, msg: Msg) -> None:
        """A master (re)started: mount again now rather than at the next heartbeat (unless
        a mount is under way)."""
        if self._mounted.is_set() and not self._mount_lock.locked():
            self._spawn(self._mount())

    async def _mount(self) -> None:
        """Mount every segment and report what they hold; retried until a master answers.
        One at a time: a mount that finds another under way leaves it to that one."""
        if self._mount_lock.locked():
            return
        async with self._mount_lock:
            await self._mount_once()

    async def _mount_once(self) -> None:
        objects = [o for by_seg in self.held.values() for o in by_seg.values()]
        req = p.MountRequest(
            node_id=self.config.node_id, segments=self.segment_infos(), objects=objects
        )
        delay = 0.1
        while True:
            # The master restarts this node's change sequence at every mount, and may send
            # its first changes before the reply arrives: expect seq 1 from now on.
            self._seq = 0
            try:
                reply = p.MountReply.model_validate_json(await self._request("mount", req))
                break
            except Exception as e:
                if self._stopping:
                    return
                log.info("mount: master not answering (%s); retrying", type(e).__name__)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
        if reply.refused:
            raise RuntimeError(f"master refused the mount: {reply.refused}")
        self.stats.mounts += 1
        self._mounted.set()
        log.info(
            "node %s mounted (adopted %d, rejected %d)",
            self.config.node_id,
            reply.adopted,
            reply.rejected,
        )
        if reply.rejected:
            await self._resync()

    async def _heartbeat_loop(self) -> None:
        req = p.HeartbeatRequest(node_id=self.config.node_id)
        while not self._stopping:
            await asyncio.sleep(self.config.heartbeat_s)
            try:
                reply = p.OkReply.model_validate_json(await self._request("heartbeat", req))
            except Exception as e:
                log.warning("heartbeat failed: %s", type(e).__name__)
                continue
            if reply.refused is not None:  # the master restarted and does not know us
                log.warning("master does not know node %s: re-mounting", self.config.node_id)
                await self._mount()

    # --- what the segments hold -------------------------------------------------------------

    def _on_ssd(self, key: str) -> bool | None:
        """Whether this node keeps `key` only on SSD (None: it does not hold it)."""
        by_seg = self.held.get(key)
        if not by_seg:
            return None
        return all(self._tier(sid) is Tier.SSD for sid in by_seg)

    def _tier(self, segment_id: str) -> Tier:
        try:
            return self.table.get(segment_id).info.tier
        except TransferError:  # a segment the master names but this node does not have
            return Tier.DRAM

    def _apply(self, update: p.NodeUpdate, kv: _KvDelta) -> None:
        before = self._on_ssd(update.key)
        if update.held:
            self.held[update.key] = {o.segment_id: o for o in update.held}
        else:
            self.held.pop(update.key, None)
        kv.note(update.key, before, self._on_ssd(update.key))

    async def _on_changes(self, msg: Msg) -> None:
        try:
            changes = p.NodeChanges.model_validate_json(msg.data)
        except Exception:
            log.warning("unreadable NodeChanges ignored")
            return
        if changes.seq <= self._seq:
            return
        if changes.seq != self._seq + 1:
            self.stats.change_gaps += 1
            await self._resync()
            return
        self._seq = changes.seq
        kv = _KvDelta()
        for u in changes.updates:
            self._apply(u, kv)
        await self._publish_kv(kv)

    async def _resync(self) -> None:
        """Replace the map by the master's listing (a notification was lost)."""
        async with self._resync_lock:
            try:
                data = await self._request(
                    "node_objects", p.NodeObjectsRequest(node_id=self.config.node_id)
                )
                listing = p.NodeObjects.model_validate_json(data)
            except Exception as e:
                log.warning("resync failed: %s", e)
                return
            old = {key: self._on_ssd(key) for key in self.held}
            self.held = {}
            for o in listing.objects:
                self.held.setdefault(o.key, {})[o.segment_id] = o
            self._seq = listing.seq
            kv = _KvDelta()
            for key in sorted(old.keys() | self.held.keys()):
                kv.note(key, old.get(key), self._on_ssd(key))
            await self._publish_kv(kv)

    async def _publish_kv(self, kv: _KvDelta) -> None:
        if not kv:
            return
        batch = self.kv_log.record(kv.stored, kv.removed, ssd=kv.ssd, dram=kv.dram)
        self.stats.kv_batches += 1
        with contextlib.suppress(Exception):
            await self.nc.publish(self.subjects.kv_events(self.config.node_id), batch_bytes(batch))

    async def _tip_loop(self) -> None:
        """Where this node's KV events stand, every TIP_EVERY_S on a timer of its own (not
        behind the master's heartbeat, which a slow or absent master holds up): a follower
        that missed the last batch sees the gap (store/kv_index.py `KvTip`), and one that
        hears nothing for SILENT_S counts this node's blocks as unknown."""
        subject = self.subjects.kv_events(self.config.node_id)
        while not self._stopping:
            with contextlib.suppress(Exception):
                await self.nc.publish(subject, tip_bytes(self.kv_log))
            await asyncio.sleep(TIP_EVERY_S)

    async def _on_snapshot(self, msg: Msg) -> None:
        await answer_snapshot(self.kv_log, msg)

    # --- moves between own segments (SSD offload on eviction, promotion on hit) -----------

    async def _on_move(self, msg: Msg) -> None:
        reply = p.OkReply()
        try:
            req = p.MoveRequest.model_validate_json(msg.data)
            if req.src.size != req.dst.size:
                raise TransferError("bad_request", "sizes differ")
            src = self.table.resolve(Region(req.src.segment_id, req.src.offset, req.src.size))
            dst = self.table.resolve(Region(req.dst.segment_id, req.dst.offset, req.dst.size))
            dst[:] = src
            seg = self.table.get(req.dst.segment_id)
            if seg.info.tier is Tier.SSD:
                seg.flush(req.dst.offset, req.dst.size)
            self.stats.moves += 1
            metrics.STORE_MOVES.labels(req.src.tier.value, req.dst.tier.value).inc()
        except Exception as e:
            log.warning("move refused: %s", e)
            reply = p.OkReply(refused=p.Refused(reason="invalid", detail=str(e)[:500]))
        if msg.reply:
            with contextlib.suppress(Exception):
                await msg.respond(reply.model_dump_json().encode())


class _KvDelta:
    """What changed in the node's key set and tiers, as one KV event batch
    (store/kv_index.py): a key's state is None (not held), False (in DRAM) or True (only on
    SSD). A key changed several times in one batch (removed, then put again) counts by its
    state before the first change and after the last: a batch applies stored before
    removed, so "removed and stored again" must not reach it as both."""

    def __init__(self) -> None:
        self._changed: dict[str, tuple[bool | None, bool | None]] = {}

    def __bool__(self) -> bool:
        return any(before != after for before, after in self._changed.values())

    def note(self, key: str, before: bool | None, after: bool | None) -> None:
        first = self._changed.get(key)
        self._changed[key] = (before if first is None else first[0], after)

    @property
    def stored(self) -> list[str]:
        return [k for k, (b, a) in self._changed.items() if b is None and a is not None]

    @property
    def removed(self) -> list[str]:
        return [k for k, (b, a) in self._changed.items() if b is not None and a is None]

    @property
    def ssd(self) -> list[str]:
        return [k for k, (b, a) in self._changed.items() if a is True and b is not True]

    @property
    def dram(self) -> list[str]:
        return [k for k, (b, a) in self._changed.items() if a is False and b is True]

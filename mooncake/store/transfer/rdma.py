"""The rdma transport: one-sided READ / WRITE on registered segments (pyverbs underneath).

Server: registers every segment of its table as a memory region (and follows the table: new
segments are registered, removed ones deregistered before their memory goes), then answers
connect requests through a `Rendezvous`: it creates a reliable-connected queue pair for the
client, moves it to RTS against the client's info and replies with its own info and each
segment's address, length and rkey. After that the server's CPU takes no part in transfers.

Client: one queue pair per server node, made on first use. Data moves through a registered
staging buffer per peer (one memory copy on this side; the caller's buffers are arbitrary
Python objects that cannot all be registered cheaply), in waves of many work requests posted
back to back and then polled together, so a batch costs one round trip per wave.

The handshake is authenticated: the request carries a nonce and an HMAC-SHA256 of its content
under the cluster secret, and the reply an HMAC over the same nonce and its content, so
neither side accepts keys or queue pairs from someone without the secret. `Rendezvous`
implementations: NATS request/reply (`NatsRendezvous`, subject
`<prefix>.store.rdma.<node>.connect`) and in-process (`LocalRendezvous`, for tests).

Endpoint: the server's node id (the rendezvous address). The transport is usable only where a
device exists: `available()` says why not.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import re
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Protocol

from mooncake.store.segment import Segment
from mooncake.store.transfer.auth import check_secret
from mooncake.store.transfer.base import (
    Buffer,
    SegmentTable,
    TransferError,
    Transport,
    TransportServer,
    as_memoryview,
    check_bounds,
    check_length,
)
from mooncake.store.transfer.verbs import (
    MemoryRegion,
    PyverbsContext,
    QpInfo,
    VerbsContext,
    VerbsQp,
    pyverbs_status,
)
from mooncake.store.types import Region

log = logging.getLogger(__name__)

Handler = Callable[[bytes], Awaitable[bytes]]
VerbsFactory = Callable[[], VerbsContext]
_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")
PROTOCOL = 1


def available() -> tuple[bool, str]:
    return pyverbs_status()


def _rendezvous(
    rendezvous: Rendezvous | None, nc: Any | None, subject_prefix: str | None
) -> Rendezvous:
    """The given rendezvous, or one over NATS built from a connected client and a prefix."""
    if rendezvous is not None:
        return rendezvous
    if nc is None or subject_prefix is None:
        raise ValueError("rdma needs rendezvous=..., or nc=... and subject_prefix=...")
    return NatsRendezvous(nc, subject_prefix)


def _open_context(verbs: VerbsFactory | None, device: str | None) -> VerbsContext:
    if verbs is not None:
        return verbs()
    ok, why = pyverbs_status()
    if not ok:
        raise TransferError("unavailable", why)
    return PyverbsContext(device)


# --- rendezvous ---------------------------------------------------------------------------------


class Rendezvous(Protocol):
    async def serve(self, node_id: str, handler: Handler) -> None: ...

    async def unserve(self, node_id: str) -> None: ...

    async def request(self, node_id: str, payload: bytes, timeout_s: float) -> bytes: ...


class LocalRendezvous:
    """In-process rendezvous: node id -> handler (tests, single-process setups)."""

    def __init__(self) -> None:
        self._handlers: dict[str, Handler] = {}

    async def serve(self, node_id: str, handler: Handler) -> None:
        self._handlers[node_id] = handler

    async def unserve(self, node_id: str) -> None:
        self._handlers.pop(node_id, None)

    async def request(self, node_id: str, payload: bytes, timeout_s: float) -> bytes:
        handler = self._handlers.get(node_id)
        if handler is None:
            raise TransferError("unreachable", f"no rdma server for node {node_id!r}")
        return await asyncio.wait_for(handler(payload), timeout_s)


class NatsRendezvous:
    """Rendezvous over NATS request/reply on `<prefix>.store.rdma.<node>.connect`."""

    def __init__(self, nc: Any, prefix: str) -> None:  # nc: a connected nats.aio.client.Client
        self._nc = nc
        self._prefix = prefix
        self._subs: dict[str, Any] = {}

    def subject(self, node_id: str) -> str:
        if not _TOKEN.match(node_id):
            raise ValueError(f"node id {node_id!r} is not a NATS subject token")
        return f"{self._prefix}.store.rdma.{node_id}.connect"

    async def serve(self, node_id: str, handler: Handler) -> None:
        async def on_message(msg: Any) -> None:
            try:
                reply = await handler(msg.data)
            except Exception:
                log.exception("rdma: connect handler failed")
                reply = json.dumps({"error": "unavailable"}).encode()
            await msg.respond(reply)

        self._subs[node_id] = await self._nc.subscribe(self.subject(node_id), cb=on_message)

    async def unserve(self, node_id: str) -> None:
        sub = self._subs.pop(node_id, None)
        if sub is not None:
            await sub.unsubscribe()

    async def request(self, node_id: str, payload: bytes, timeout_s: float) -> bytes:
        try:
            msg = await self._nc.request(self.subject(node_id), payload, timeout=timeout_s)
        except ValueError:
            raise
        except Exception as exc:  # nats: no responders, timeout, connection closed
            raise TransferError("unreachable", f"rdma connect to {node_id}: {exc!r}") from exc
        data: bytes = msg.data
        return data


# --- handshake messages (pure) ------------------------------------------------------------------


def _canonical(body: dict[str, Any]) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _mac(secret: bytes, label: bytes, body: dict[str, Any]) -> str:
    return hmac.new(secret, label + _canonical(body), hashlib.sha256).hexdigest()


def connect_request(secret: bytes, info: QpInfo) -> tuple[bytes, str]:
    nonce = secrets.token_hex(16)
    body = {"v": PROTOCOL, "nonce": nonce, "qp": asdict(info)}
    return _canonical({**body, "mac": _mac(secret, b"mc-rdma-req", body)}), nonce


def open_request(secret: bytes, payload: bytes) -> tuple[str, QpInfo]:
    """(nonce, client QP info) of an authentic request; TransferError otherwise."""
    body = _open(payload)
    mac = body.pop("mac", "")
    if not isinstance(mac, str) or not hmac.compare_digest(mac, _mac(secret, b"mc-rdma-req", body)):
        raise TransferError("auth", "rdma connect request without a valid HMAC")
    return str(body["nonce"]), _qp_info(body.get("qp"))


def connect_reply(
    secret: bytes, nonce: str, info: QpInfo, segments: dict[str, tuple[int, int, int]]
) -> bytes:
    body = {
        "nonce": nonce,
        "qp": asdict(info),
        "segments": {k: list(v) for k, v in segments.items()},
    }
    return _canonical({**body, "mac": _mac(secret, b"mc-rdma-rep", body)})


def open_reply(
    secret: bytes, nonce: str, payload: bytes
) -> tuple[QpInfo, dict[str, tuple[int, int, int]]]:
    body = _open(payload)
    if "error" in body:
        if body["error"] == "auth":
            raise TransferError("auth", "rdma server refused our credentials")
        raise TransferError("unavailable", f"rdma server refused: {body['error']!r}")
    mac = body.pop("mac", "")
    if not isinstance(mac, str) or not hmac.compare_digest(mac, _mac(secret, b"mc-rdma-rep", body)):
        raise TransferError("auth", "rdma connect reply without a valid HMAC")
    if body.get("nonce") != nonce:
        raise TransferError("auth", "rdma connect reply to another request")
    try:
        segments = {str(k): (int(v[0]), int(v[1]), int(v[2])) for k, v in body["segments"].items()}
    except (KeyError, TypeError, ValueError, IndexError, AttributeError):
        raise TransferError("bad_request", "malformed rdma segment table") from None
    return _qp_info(body.get("qp")), segments


def _open(payload: bytes) -> dict[str, Any]:
    try:
        body = json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        raise TransferError("bad_request", "rdma handshake is not JSON") from None
    if not isinstance(body, dict):
        raise TransferError("bad_request", "rdma handshake is not an object")
    return body


def _qp_info(raw: Any) -> QpInfo:
    try:
        return QpInfo(int(raw["lid"]), str(raw["gid"]), int(raw["qpn"]), int(raw["psn"]))
    except (KeyError, TypeError, ValueError):
        raise TransferError("bad_request", "malformed queue-pair info") from None


# --- server -------------------------------------------------------------------------------------


class RdmaServer(TransportServer):
    name: ClassVar[str] = "rdma"

    def __init__(
        self,
        *,
        secret: bytes,
        node_id: str | None = None,
        rendezvous: Rendezvous | None = None,
        nc: Any | None = None,
        subject_prefix: str | None = None,
        verbs: VerbsFactory | None = None,
        device: str | None = None,
        qp_depth: int = 128,
        max_qps: int = 1024,
    ) -> None:
        self._secret = check_secret(secret)
        # The endpoint is the rendezvous address; without a node id a random one will do.
        self._node = node_id or f"rdma-{secrets.token_hex(8)}"
        if not _TOKEN.match(self._node):
            raise ValueError(f"node id {self._node!r} must match {_TOKEN.pattern}")
        self._rendezvous = _rendezvous(rendezvous, nc, subject_prefix)
        self._verbs = verbs
        self._device = device
        self._depth = qp_depth
        self._max_qps = max_qps
        self._ctx: VerbsContext | None = None
        self._table: SegmentTable | None = None
        self._mrs: dict[str, MemoryRegion] = {}
        self._qps: list[VerbsQp] = []
        self._lock = threading.Lock()
        self._unwatch: Callable[[], None] | None = None

    async def start(self, table: SegmentTable) -> None:
        self._ctx = _open_context(self._verbs, self._device)
        self._table = table
        self._unwatch = table.watch(self._on_change)
        for segment in table.segments():
            self._register(segment)
        await self._rendezvous.serve(self._node, self._handle)

    def endpoint(self, segment_id: str) -> str:
        if self._table is None:
            raise RuntimeError("server not started")
        self._table.get(segment_id)
        return self._node

    async def stop(self) -> None:
        await self._rendezvous.unserve(self._node)
        if self._unwatch is not None:
            self._unwatch()
        ctx, self._ctx = self._ctx, None
        with self._lock:
            qps, self._qps = self._qps, []
            mrs, self._mrs = self._mrs, {}
        for qp in qps:
            qp.close()
        if ctx is not None:
            for mr in mrs.values():
                ctx.deregister(mr)
            ctx.close()

    def _on_change(self, kind: str, segment: Segment) -> None:
        if kind == "add":
            self._register(segment)
        else:
            with self._lock:
                mr = self._mrs.pop(segment.info.segment_id, None)
            if mr is not None and self._ctx is not None:
                self._ctx.deregister(mr)

    def _register(self, segment: Segment) -> None:
        assert self._ctx is not None
        with self._lock:
            if segment.info.segment_id in self._mrs:
                return
            self._mrs[segment.info.segment_id] = self._ctx.register(segment.buf)

    async def _handle(self, payload: bytes) -> bytes:
        try:
            nonce, client = open_request(self._secret, payload)
        except TransferError as exc:
            log.warning("rdma: refused connect request on %s: %s", self._node, exc)
            return _canonical({"error": exc.reason})
        if self._ctx is None:
            return _canonical({"error": "unavailable"})
        qp = self._ctx.create_qp(self._depth)
        try:
            qp.connect(client)
        except Exception as exc:
            qp.close()
            log.warning("rdma: cannot connect to client qp %s: %s", client, exc)
            return _canonical({"error": "unavailable"})
        with self._lock:
            self._qps.append(qp)
            while len(self._qps) > self._max_qps:  # oldest clients reconnect if they come back
                self._qps.pop(0).close()
            segments = {sid: (mr.addr, mr.length, mr.rkey) for sid, mr in self._mrs.items()}
        return connect_reply(self._secret, nonce, qp.info(), segments)


# --- client -------------------------------------------------------------------------------------


@dataclass
class _Peer:
    qp: VerbsQp
    segments: dict[str, tuple[int, int, int]]  # segment id -> (addr, length, rkey)
    staging: memoryview
    staging_mr: MemoryRegion
    lock: asyncio.Lock
    closed: bool = False


@dataclass(frozen=True)
class _Piece:
    """One work request: `length` bytes between caller memory and a remote address."""

    view: memoryview
    remote_addr: int
    rkey: int


class RdmaTransport(Transport):
    name: ClassVar[str] = "rdma"

    def __init__(
        self,
        *,
        secret: bytes,
        rendezvous: Rendezvous | None = None,
        nc: Any | None = None,
        subject_prefix: str | None = None,
        verbs: VerbsFactory | None = None,
        device: str | None = None,
        staging_bytes: int = 16 << 20,
        qp_depth: int = 128,
        timeout_s: float = 10.0,
    ) -> None:
        self._secret = check_secret(secret)
        self._rendezvous = _rendezvous(rendezvous, nc, subject_prefix)
        self._verbs = verbs
        self._device = device
        self._staging = staging_bytes
        self._depth = qp_depth
        self._timeout = timeout_s
        self._ctx: VerbsContext | None = None
        self._peers: dict[str, _Peer] = {}
        self._connecting: dict[str, asyncio.Lock] = {}
        self._usable = verbs is not None or pyverbs_status()[0]

    def reaches(self, endpoint: str) -> bool:
        return self._usable and bool(_TOKEN.match(endpoint))

    async def write(self, endpoint: str, region: Region, data: Buffer) -> None:
        await self.write_many(endpoint, [(region, data)])

    async def read_into(self, endpoint: str, region: Region, out: Buffer) -> None:
        await self.read_many(endpoint, [(region, out)])

    async def write_many(self, endpoint: str, ops: Sequence[tuple[Region, Buffer]]) -> None:
        await self._transfer(endpoint, ops, write=True)

    async def read_many(self, endpoint: str, ops: Sequence[tuple[Region, Buffer]]) -> None:
        await self._transfer(endpoint, ops, write=False)

    async def close(self) -> None:
        for endpoint, peer in list(self._peers.items()):
            self._close_peer(endpoint, peer)
        if self._ctx is not None:
            self._ctx.close()
            self._ctx = None

    async def _transfer(
        self, endpoint: str, ops: Sequence[tuple[Region, Buffer]], *, write: bool
    ) -> None:
        views = []
        for region, buf in ops:
            view = as_memoryview(buf, writable=not write)
            check_length(region, view)
            views.append(view)
        refreshed = False
        while True:
            peer = await self._peer(endpoint)
            if not refreshed and any(r.segment_id not in peer.segments for r, _ in ops):
                refreshed = True  # the node may have added segments since we connected
                await self._retire(endpoint, peer)
                continue
            pieces = [
                self._piece(peer, region, view)
                for (region, _), view in zip(ops, views, strict=True)
            ]
            async with peer.lock:
                if peer.closed:  # retired while we waited: connect again
                    continue
                try:
                    await asyncio.to_thread(self._move, peer, pieces, write)
                except TransferError:
                    self._close_peer(endpoint, peer)  # a failed WR leaves the QP in error
                    raise
                except Exception as exc:  # the verbs layer refused to post
                    self._close_peer(endpoint, peer)
                    raise TransferError("connection", f"rdma: {exc}") from exc
                return

    async def _retire(self, endpoint: str, peer: _Peer) -> None:
        if self._peers.get(endpoint) is peer:
            del self._peers[endpoint]
        async with peer.lock:  # let transfers in flight on it finish first
            self._close_peer(endpoint, peer)

    def _close_peer(self, endpoint: str, peer: _Peer) -> None:
        if self._peers.get(endpoint) is peer:
            del self._peers[endpoint]
        if peer.closed:
            return
        peer.closed = True
        peer.qp.close()
        if self._ctx is not None:
            self._ctx.deregister(peer.staging_mr)

    def _piece(self, peer: _Peer, region: Region, view: memoryview) -> _Piece:
        try:
            addr, length, rkey = peer.segments[region.segment_id]
        except KeyError:
            raise TransferError("unknown_segment", repr(region.segment_id)) from None
        check_bounds(region.offset, region.length, length)
        return _Piece(view, addr + region.offset, rkey)

    def _move(self, peer: _Peer, pieces: list[_Piece], write: bool) -> None:
        """Waves of work requests through the staging buffer (runs in a worker thread)."""
        wave: list[tuple[int, _Piece, int, int]] = []  # (staging offset, piece, start, n)
        used = 0
        for piece in pieces:
            start = 0
            total = piece.view.nbytes
            while start < total:
                n = min(total - start, self._staging - used)
                wave.append((used, piece, start, n))
                used += n
                start += n
                if used == self._staging or len(wave) == self._depth:
                    self._run_wave(peer, wave, write)
                    wave, used = [], 0
        if wave:
            self._run_wave(peer, wave, write)

    def _run_wave(self, peer: _Peer, wave: list[tuple[int, _Piece, int, int]], write: bool) -> None:
        base = peer.staging_mr.addr
        for wr_id, (pos, piece, start, n) in enumerate(wave):
            remote = piece.remote_addr + start
            if write:
                peer.staging[pos : pos + n] = piece.view[start : start + n]
                peer.qp.post_write(wr_id, peer.staging_mr, base + pos, n, remote, piece.rkey)
            else:
                peer.qp.post_read(wr_id, peer.staging_mr, base + pos, n, remote, piece.rkey)
        deadline = time.monotonic() + self._timeout
        done = 0
        while done < len(wave):
            completions = peer.qp.poll(len(wave) - done)
            for completion in completions:
                if not completion.ok:
                    raise TransferError(
                        "connection", f"rdma work request failed: {completion.status}"
                    )
            done += len(completions)
            if not completions:
                if time.monotonic() > deadline:
                    raise TransferError("connection", "rdma completions timed out")
                time.sleep(0)  # busy poll, but let other threads in
        if not write:
            for pos, piece, start, n in wave:
                piece.view[start : start + n] = peer.staging[pos : pos + n]

    async def _peer(self, endpoint: str) -> _Peer:
        peer = self._peers.get(endpoint)
        if peer is not None:
            return peer
        lock = self._connecting.setdefault(endpoint, asyncio.Lock())
        async with lock:
            peer = self._peers.get(endpoint)
            if peer is None:
                peer = self._peers[endpoint] = await self._connect(endpoint)
            return peer

    async def _connect(self, endpoint: str) -> _Peer:
        if not self.reaches(endpoint):
            raise TransferError("unavailable" if not self._usable else "unreachable", endpoint)
        if self._ctx is None:
            self._ctx = _open_context(self._verbs, self._device)
        ctx = self._ctx
        qp = ctx.create_qp(self._depth)
        staging = memoryview(bytearray(self._staging))
        staging_mr = ctx.register(staging)
        try:
            payload, nonce = connect_request(self._secret, qp.info())
            reply = await self._rendezvous.request(endpoint, payload, self._timeout)
            remote, segments = open_reply(self._secret, nonce, reply)
            qp.connect(remote)
        except BaseException:
            qp.close()
            ctx.deregister(staging_mr)
            raise
        return _Peer(qp, segments, staging, staging_mr, asyncio.Lock())

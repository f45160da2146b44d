"""The tcp transport: authenticated, framed, pooled connections; zero intermediate copies.

Server: one accepting thread and one thread per connection, with blocking sockets. A thread
that sits in `recv_into`/`sendmsg` releases the GIL, and on this workload (large contiguous
transfers) threads measured faster than asyncio's `sock_recv_into`, whose per-call readiness
dance costs a wake-up per chunk. Writes are received straight into segment memory, reads sent
straight out of it (`frames.py` describes the wire format, `auth.py` the handshake).

Client: per endpoint, a pool of persistent authenticated connections; each blocking exchange
runs in a worker thread. A large transfer is cut into slices spread over several connections;
a batch of small ops is packed into vectored frames (one round trip for many regions).

Untrusted input never crashes the server nor reaches outside a segment: every frame is
validated by `frames`, every region resolved through `SegmentTable.resolve`, and a connection
whose framing is broken is logged and closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import socket
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

from mooncake.store.transfer import frames, netio
from mooncake.store.transfer.auth import (
    HANDSHAKE_TIMEOUT_S,
    AuthError,
    check_secret,
    client_handshake,
    server_handshake,
)
from mooncake.store.transfer.base import (
    Buffer,
    SegmentTable,
    TransferError,
    Transport,
    TransportServer,
    as_memoryview,
    check_length,
)
from mooncake.store.types import Region

log = logging.getLogger(__name__)

SOCK_BUF = 4 << 20  # socket buffers: big enough that a sender rarely waits for the reader


def available() -> tuple[bool, str]:
    return True, "tcp works everywhere"


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCK_BUF)


# --- server -------------------------------------------------------------------------------------


class TcpServer(TransportServer):
    name: ClassVar[str] = "tcp"

    def __init__(
        self,
        *,
        secret: bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
    ) -> None:
        self._secret = check_secret(secret)
        self._host = host
        self._port = port
        self._advertise = advertise_host or host
        self._table: SegmentTable | None = None
        self._listener: socket.socket | None = None
        self._threads: set[threading.Thread] = set()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopping = False

    @property
    def port(self) -> int:
        return self._port

    async def start(self, table: SegmentTable) -> None:
        if self._listener is not None:
            raise RuntimeError("server already started")
        self._table = table
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        listener = socket.create_server((self._host, self._port), family=family, backlog=256)
        self._port = listener.getsockname()[1]
        self._listener = listener
        self._spawn(self._accept_loop, listener, name=f"tcp-accept-{self._port}")
        log.info("tcp transport serving on %s", netio.format_host_port(self._host, self._port))

    def endpoint(self, segment_id: str) -> str:
        if self._listener is None:
            raise RuntimeError("server not started")
        return netio.format_host_port(self._advertise, self._port)

    async def stop(self) -> None:
        self._stopping = True
        listener, self._listener = self._listener, None
        with self._lock:
            socks = list(self._conns)
            threads = list(self._threads)
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
            listener.close()
        for conn in socks:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for thread in threads:
            await asyncio.to_thread(thread.join, 5.0)

    def _spawn(self, target: Any, *args: Any, name: str) -> None:
        thread = threading.Thread(target=self._run, args=(target, *args), name=name, daemon=True)
        with self._lock:
            self._threads.add(thread)
        thread.start()

    def _run(self, target: Any, *args: Any) -> None:
        try:
            target(*args)
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _accept_loop(self, listener: socket.socket) -> None:
        while not self._stopping:
            try:
                conn, peer = listener.accept()
            except OSError:
                if self._stopping:
                    return
                log.exception("tcp accept failed")
                continue
            with self._lock:
                self._conns.add(conn)
            self._spawn(self._serve, conn, peer, name=f"tcp-conn-{peer}")

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        try:
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            try:
                server_handshake(conn, self._secret)
            except (AuthError, OSError) as exc:
                log.warning("tcp: refused connection from %s: %s", peer, exc)
                return
            conn.settimeout(None)
            _tune(conn)
            self._serve_frames(conn)
        except frames.FrameError as exc:
            log.warning("tcp: malformed frame from %s, closing: %s", peer, exc)
        except OSError as exc:
            if not self._stopping:
                log.info("tcp: connection from %s ended: %s", peer, exc)
        except Exception:  # a bug must cost one connection, never the server
            log.exception("tcp: error serving %s", peer)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _serve_frames(self, conn: socket.socket) -> None:
        head = memoryview(bytearray(frames.HEADER_SIZE))
        while netio.recv_exact_into(conn, head):
            header = frames.decode_header(head)
            if header.op is frames.Op.REPLY:
                raise frames.FrameError("a reply where a request was expected")
            regions = frames.decode_ops(header, netio.recv_exact(conn, header.body_len))
            views, error = self._resolve(regions)
            if header.op is frames.Op.WRITE:
                if error is None:
                    netio.recv_views(conn, views)
                else:
                    netio.discard(conn, frames.payload_length(regions))
            if error is not None:
                log.warning("tcp: refused %s: %s", header.op.name, error)
                conn.sendall(
                    frames.encode_reply(header.request_id, header.count, error.reason, error.detail)
                )
                continue
            reply = frames.encode_reply(header.request_id, header.count)
            if header.op is frames.Op.READ:
                netio.send_views(conn, [reply, *views])
            else:
                conn.sendall(reply)

    def _resolve(self, regions: list[Region]) -> tuple[list[memoryview], TransferError | None]:
        assert self._table is not None
        try:
            return [self._table.resolve(r) for r in regions], None
        except TransferError as exc:
            return [], exc


# --- client -------------------------------------------------------------------------------------


@dataclass
class _Conn:
    sock: socket.socket

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class _Pool:
    """Idle connections to one endpoint, at most `size` in use at once (owned by the loop)."""

    def __init__(self, size: int) -> None:
        self.idle: list[_Conn] = []
        self.slots = asyncio.Semaphore(size)


@dataclass(frozen=True)
class _Job:
    """One frame's worth of work: regions and the matching views of caller memory."""

    regions: list[Region]
    views: list[memoryview]


class TcpTransport(Transport):
    name: ClassVar[str] = "tcp"

    def __init__(
        self,
        *,
        secret: bytes,
        connections: int = 4,
        slice_bytes: int = 4 << 20,
        batch_bytes: int = 1 << 20,
        connect_timeout_s: float = 5.0,
        io_timeout_s: float = 60.0,
        inline_bytes: int = 2 << 20,
    ) -> None:
        self._secret = check_secret(secret)
        self._connections = connections
        self._slice = slice_bytes
        self._batch = batch_bytes
        self._connect_timeout = connect_timeout_s
        self._io_timeout = io_timeout_s
        self._inline = inline_bytes
        self._pools: dict[str, _Pool] = {}
        self._ids = itertools.count(1)
        self._executor = ThreadPoolExecutor(
            max_workers=max(8, 2 * connections), thread_name_prefix="tcp-client"
        )
        self._closed = False

    def reaches(self, endpoint: str) -> bool:
        try:
            netio.parse_host_port(endpoint)
        except ValueError:
            return False
        return True

    async def write(self, endpoint: str, region: Region, data: Buffer) -> None:
        await self.write_many(endpoint, [(region, data)])

    async def read_into(self, endpoint: str, region: Region, out: Buffer) -> None:
        await self.read_many(endpoint, [(region, out)])

    async def write_many(self, endpoint: str, ops: Sequence[tuple[Region, Buffer]]) -> None:
        jobs = self._plan(ops, writable=False)
        await self._run_jobs(endpoint, frames.Op.WRITE, jobs)

    async def read_many(self, endpoint: str, ops: Sequence[tuple[Region, Buffer]]) -> None:
        jobs = self._plan(ops, writable=True)
        await self._run_jobs(endpoint, frames.Op.READ, jobs)

    async def close(self) -> None:
        self._closed = True
        for pool in self._pools.values():
            for conn in pool.idle:
                conn.close()
            pool.idle.clear()
        self._pools.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # planning: slices of big ops, packed frames of small ones

    def _plan(self, ops: Sequence[tuple[Region, Buffer]], *, writable: bool) -> list[_Job]:
        jobs: list[_Job] = []
        regions: list[Region] = []
        views: list[memoryview] = []
        size = 0
        for region, buf in ops:
            view = as_memoryview(buf, writable=writable)
            check_length(region, view)
            if region.offset < 0 or region.length < 0:
                raise TransferError("out_of_bounds", f"{region.offset}+{region.length}")
            if region.length > self._slice:
                for start in range(0, region.length, self._slice):
                    n = min(self._slice, region.length - start)
                    sub = Region(region.segment_id, region.offset + start, n)
                    jobs.append(_Job([sub], [view[start : start + n]]))
                continue
            if regions and (size + region.length > self._batch or len(regions) >= frames.MAX_OPS):
                jobs.append(_Job(regions, views))
                regions, views, size = [], [], 0
            regions.append(region)
            views.append(view)
            size += region.length
        if regions:
            jobs.append(_Job(regions, views))
        for job in jobs:
            for r in job.regions:
                if not 0 < len(r.segment_id.encode()) <= frames.MAX_SEGMENT_ID:
                    raise TransferError("bad_request", f"segment id {r.segment_id!r}")
                if r.offset > frames.MAX_OFFSET:
                    raise TransferError("out_of_bounds", f"offset {r.offset}")
        return jobs

    async def _run_jobs(self, endpoint: str, op: frames.Op, jobs: list[_Job]) -> None:
        if self._closed:
            raise TransferError("connection", "transport closed")
        if not jobs:
            return
        # Small batches stay on the event loop (a thread hop costs more than their bytes);
        # a big batch runs its jobs in threads, so several connections move bytes at once.
        inline = sum(r.length for job in jobs for r in job.regions) <= self._inline
        if len(jobs) == 1:
            await self._run_job(endpoint, op, jobs[0], inline)
            return
        results = await asyncio.gather(
            *(self._run_job(endpoint, op, job, inline) for job in jobs), return_exceptions=True
        )
        for result in results:
            if isinstance(result, BaseException):
                raise result

    async def _run_job(self, endpoint: str, op: frames.Op, job: _Job, inline: bool) -> None:
        pool = self._pools.get(endpoint)
        if pool is None:
            if not self.reaches(endpoint):
                raise TransferError("unreachable", f"not a tcp endpoint: {endpoint!r}")
            pool = self._pools[endpoint] = _Pool(self._connections)
        loop = asyncio.get_running_loop()
        async with pool.slots:
            conn = pool.idle.pop() if pool.idle else None
            if conn is None:
                conn = await loop.run_in_executor(self._executor, self._connect, endpoint)
            try:
                if inline:
                    await self._exchange_on_loop(loop, conn, op, next(self._ids), job)
                else:
                    await loop.run_in_executor(
                        self._executor, _exchange, conn, op, next(self._ids), job
                    )
            except _ConnectionLost:
                conn.close()
                raise
            except TransferError:  # the server answered in frame: the connection is still good
                pool.idle.append(conn)
                raise
            except BaseException:
                conn.close()  # cancelled or failed mid-frame: the stream is out of step
                raise
            pool.idle.append(conn)

    async def _exchange_on_loop(
        self,
        loop: asyncio.AbstractEventLoop,
        conn: _Conn,
        op: frames.Op,
        request_id: int,
        job: _Job,
    ) -> None:
        """`_exchange` without a thread hop: for small jobs the hop costs more than the bytes."""
        sock = conn.sock
        sock.setblocking(False)
        try:
            async with asyncio.timeout(self._io_timeout):
                request = frames.encode_request(op, request_id, job.regions)
                views: list[bytes | memoryview] = [request]
                if op is frames.Op.WRITE:
                    views += job.views
                await _send_views_on_loop(loop, sock, views)
                head = memoryview(bytearray(frames.HEADER_SIZE))
                await _recv_into_on_loop(loop, sock, head)
                header = frames.decode_header(head)
                message = bytearray(header.body_len)
                await _recv_into_on_loop(loop, sock, memoryview(message))
                _check_reply(header, request_id, message)
                if op is frames.Op.READ:
                    for view in job.views:
                        await _recv_into_on_loop(loop, sock, view)
        except (OSError, frames.FrameError) as exc:  # TimeoutError is an OSError
            raise _ConnectionLost("connection", str(exc) or type(exc).__name__) from exc
        finally:
            sock.settimeout(self._io_timeout)

    def _connect(self, endpoint: str) -> _Conn:
        host, port = netio.parse_host_port(endpoint)
        try:
            sock = socket.create_connection((host, port), timeout=self._connect_timeout)
        except OSError as exc:
            raise TransferError("unreachable", f"{endpoint}: {exc}") from exc
        try:
            client_handshake(sock, self._secret)
        except AuthError as exc:
            sock.close()
            raise TransferError("auth", f"{endpoint}: {exc}") from exc
        except OSError as exc:
            sock.close()
            raise TransferError("connection", f"{endpoint}: handshake: {exc}") from exc
        sock.settimeout(self._io_timeout)
        _tune(sock)
        return _Conn(sock)


class _ConnectionLost(TransferError):
    """The stream broke or went out of frame: the connection must not be reused."""


def _exchange(conn: _Conn, op: frames.Op, request_id: int, job: _Job) -> None:
    """One request/reply on `conn` (runs in a worker thread)."""
    sock = conn.sock
    request = frames.encode_request(op, request_id, job.regions)
    try:
        if op is frames.Op.WRITE:
            netio.send_views(sock, [request, *job.views])
        else:
            sock.sendall(request)
        header = frames.decode_header(netio.recv_exact(sock, frames.HEADER_SIZE))
        _check_reply(header, request_id, netio.recv_exact(sock, header.body_len))
        if op is frames.Op.READ:
            netio.recv_views(sock, job.views)
    except (OSError, frames.FrameError) as exc:
        raise _ConnectionLost("connection", str(exc) or type(exc).__name__) from exc


def _check_reply(header: frames.Header, request_id: int, body: bytes | bytearray) -> None:
    if header.request_id != request_id:
        raise frames.FrameError(f"reply to {header.request_id}, expected {request_id}")
    reason = frames.reply_reason(header)
    if reason is not None:
        raise TransferError(reason, bytes(body).decode(errors="replace"))
    if body:
        raise frames.FrameError("success reply with a body")


async def _recv_into_on_loop(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview
) -> None:
    got = 0
    while got < view.nbytes:
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            raise ConnectionError("peer closed mid-message")
        got += n


async def _send_views_on_loop(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, views: Sequence[bytes | memoryview]
) -> None:
    """Gather-send without copying: one `sendmsg` for what the socket buffer takes at once
    (usually everything), then the rest as the socket drains."""
    pending = [memoryview(v) for v in views if len(v)]
    try:
        sent = sock.sendmsg(pending[: netio.IOV_BATCH])
    except (BlockingIOError, InterruptedError):
        sent = 0
    for view in pending:
        if sent >= view.nbytes:
            sent -= view.nbytes
            continue
        await loop.sock_sendall(sock, view[sent:])
        sent = 0

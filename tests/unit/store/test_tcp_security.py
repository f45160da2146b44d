"""The tcp server refuses clients without the cluster secret and survives garbage."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from mooncake.store.segment import Segment
from mooncake.store.transfer import (
    SegmentTable,
    TransferError,
    auth,
    frames,
    make_client,
    make_server,
)
from mooncake.store.transfer.netio import parse_host_port
from mooncake.store.transfer.tcp import TcpServer
from mooncake.store.types import Region

SECRET = b"the-right-secret"


@pytest_asyncio.fixture
async def server() -> AsyncIterator[tuple[TcpServer, Segment]]:
    seg = Segment.create_dram("sec", "n", 1 << 20)
    table = SegmentTable()
    table.add(seg)
    srv = make_server("tcp", secret=SECRET)
    assert isinstance(srv, TcpServer)
    await srv.start(table)
    try:
        yield srv, seg
    finally:
        await srv.stop()
        seg.close()


async def _still_serves(srv: TcpServer) -> None:
    client = make_client("tcp", secret=SECRET)
    try:
        data = os.urandom(5000)
        await client.write(srv.endpoint("sec"), Region("sec", 77, len(data)), data)
        out = bytearray(len(data))
        await client.read_into(srv.endpoint("sec"), Region("sec", 77, len(data)), out)
        assert out == data
    finally:
        await client.close()


def _raw(srv: TcpServer) -> socket.socket:
    return socket.create_connection(parse_host_port(srv.endpoint("sec")), timeout=5)


async def _closed_by_server(sock: socket.socket) -> bool:
    def wait() -> bool:
        try:
            while chunk := sock.recv(4096):
                del chunk
            return True
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False

    try:
        return await asyncio.to_thread(wait)
    finally:
        sock.close()


async def test_wrong_secret_is_refused_and_logged(
    server: tuple[TcpServer, Segment], caplog: pytest.LogCaptureFixture
) -> None:
    srv, seg = server
    caplog.set_level(logging.WARNING, logger="mooncake.store.transfer.tcp")
    intruder = make_client("tcp", secret=b"a-wrong-secret")
    try:
        with pytest.raises(TransferError) as err:
            await intruder.write(srv.endpoint("sec"), Region("sec", 0, 4), b"evil")
        assert err.value.reason == "auth"
    finally:
        await intruder.close()
    assert bytes(seg.buf[:4]) == bytes(4)
    # The client gives up as soon as the server's proof does not check out; the server notices
    # the abandoned handshake a moment later, in its own thread.
    for _ in range(200):
        if any("refused connection" in r.getMessage() for r in caplog.records):
            break
        await asyncio.sleep(0.01)
    assert any("refused connection" in r.getMessage() for r in caplog.records)
    await _still_serves(srv)


async def test_wrong_client_proof_is_refused_and_logged(
    server: tuple[TcpServer, Segment], caplog: pytest.LogCaptureFixture
) -> None:
    srv, _ = server
    caplog.set_level(logging.WARNING, logger="mooncake.store.transfer.tcp")
    sock = _raw(srv)
    sock.sendall(auth.MAGIC + bytes([auth.VERSION]) + os.urandom(auth.NONCE))
    auth.recv_exact(sock, auth.NONCE + auth.MAC)
    sock.sendall(os.urandom(auth.MAC))  # a proof made without the secret
    assert await _closed_by_server(sock)
    assert any("client does not know the cluster secret" in r.getMessage() for r in caplog.records)


async def test_client_refuses_a_server_without_the_secret(
    server: tuple[TcpServer, Segment],
) -> None:
    srv, _ = server
    # Against a real server the client's proof is what fails; what the client itself checks
    # is the server's proof, so speak the handshake by hand with the wrong key on the server side.
    a, b = socket.socketpair()
    try:
        fake_server = asyncio.to_thread(auth.server_handshake, b, b"not-the-secret")
        with pytest.raises(auth.AuthError, match="server does not know"):
            await asyncio.gather(asyncio.to_thread(auth.client_handshake, a, SECRET), fake_server)
    finally:
        a.close()
        b.close()
    await _still_serves(srv)


async def test_no_handshake_means_no_service(
    server: tuple[TcpServer, Segment], caplog: pytest.LogCaptureFixture
) -> None:
    srv, seg = server
    caplog.set_level(logging.WARNING, logger="mooncake.store.transfer.tcp")
    sock = _raw(srv)
    # a well-formed write frame, but no handshake first
    sock.sendall(frames.encode_request(frames.Op.WRITE, 1, [Region("sec", 0, 4)]) + b"evil")
    assert await _closed_by_server(sock)
    assert bytes(seg.buf[:4]) == bytes(4)
    assert any("not a mooncake handshake" in r.getMessage() for r in caplog.records)
    await _still_serves(srv)


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x00" * 64,
        os.urandom(4096),
        frames.MAGIC + b"\x01\x07" + bytes(18),  # unknown op
        frames.encode_request(frames.Op.READ, 1, [Region("sec", 0, 8)])[:-3],  # then EOF
        frames.encode_header(frames.Header(frames.Op.READ, 0, 1, 1, frames.MAX_BODY + 1)),
    ],
)
async def test_garbage_after_handshake_closes_only_that_connection(
    server: tuple[TcpServer, Segment], caplog: pytest.LogCaptureFixture, garbage: bytes
) -> None:
    srv, _ = server
    caplog.set_level(logging.INFO, logger="mooncake.store.transfer.tcp")
    sock = _raw(srv)
    await asyncio.to_thread(auth.client_handshake, sock, SECRET)
    with contextlib.suppress(OSError):  # the server may hang up before we are done
        sock.sendall(garbage)
        sock.shutdown(socket.SHUT_WR)
    assert await _closed_by_server(sock)
    await _still_serves(srv)
    assert any(
        "malformed frame" in r.getMessage() or "ended" in r.getMessage() for r in caplog.records
    )


async def test_garbage_before_handshake(server: tuple[TcpServer, Segment]) -> None:
    srv, _ = server
    for _ in range(3):
        sock = _raw(srv)
        with contextlib.suppress(OSError):
            sock.sendall(os.urandom(1000))
        assert await _closed_by_server(sock)
    await _still_serves(srv)


def test_empty_secret_is_rejected() -> None:
    with pytest.raises(ValueError):
        make_server("tcp", secret=b"")
    with pytest.raises(ValueError):
        make_client("tcp", secret=b"")


async def test_unreachable_endpoint() -> None:
    client = make_client("tcp", secret=SECRET)
    try:
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
        probe.close()  # nothing listens there now
        with pytest.raises(TransferError) as err:
            await client.read_into(f"127.0.0.1:{port}", Region("s", 0, 1), bytearray(1))
        assert err.value.reason == "unreachable"
        assert not client.reaches("no-port-here")
    finally:
        await client.close()

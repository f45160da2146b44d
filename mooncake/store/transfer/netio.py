"""Blocking socket helpers that move bytes straight between sockets and caller memory.

Vectored (`sendmsg` / `recvmsg_into`) so that a batch of small regions costs a handful of
system calls, and no intermediate buffer: the kernel copies into or out of the final place.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence

IOV_BATCH = 512  # well under IOV_MAX (1024 on Linux)


def recv_exact_into(sock: socket.socket, view: memoryview) -> bool:
    """Fill `view`; False on a clean EOF before the first byte, ConnectionError mid-way."""
    got = 0
    n = len(view)
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0:
                return False
            raise ConnectionError("peer closed mid-message")
        got += k
    return True


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    if n and not recv_exact_into(sock, memoryview(buf)):
        raise ConnectionError("peer closed")
    return bytes(buf)


def recv_views(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """Fill every view in order from the stream (scatter read)."""
    if len(views) == 1:
        if views[0].nbytes and not recv_exact_into(sock, views[0]):
            raise ConnectionError("peer closed")
        return
    pending = [v for v in views if v.nbytes]
    i = 0
    while i < len(pending):
        batch = pending[i : i + IOV_BATCH]
        k = sock.recvmsg_into(batch)[0]
        if k == 0:
            raise ConnectionError("peer closed mid-message")
        for v in batch:  # consume k bytes from the front
            if k >= v.nbytes:
                k -= v.nbytes
                i += 1
            else:
                pending[i] = v[k:]
                break


def send_views(sock: socket.socket, views: Sequence[bytes | memoryview]) -> None:
    """Send every buffer in order (gather write)."""
    pending = [memoryview(v) for v in views if len(v)]
    i = 0
    while i < len(pending):
        batch = pending[i : i + IOV_BATCH]
        k = sock.sendmsg(batch)
        for v in batch:
            if k >= v.nbytes:
                k -= v.nbytes
                i += 1
            else:
                pending[i] = v[k:]
                break


def discard(sock: socket.socket, n: int, chunk: int = 1 << 20) -> None:
    """Read and drop `n` bytes (the payload of a refused write keeps the stream in frame)."""
    scratch = memoryview(bytearray(min(n, chunk)))
    while n > 0:
        k = sock.recv_into(scratch[: min(n, len(scratch))])
        if k == 0:
            raise ConnectionError("peer closed mid-payload")
        n -= k


def parse_host_port(endpoint: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port); ValueError if malformed."""
    host, sep, port_s = endpoint.rpartition(":")
    if not sep or not host or not port_s.isdigit():
        raise ValueError(f"not a host:port endpoint: {endpoint!r}")
    port = int(port_s)
    if not 0 < port < 65536:
        raise ValueError(f"bad port in {endpoint!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, port


def format_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

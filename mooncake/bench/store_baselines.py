"""Baselines for `mooncake bench store`, and the raw transport throughput measured against them.

- `tcp_baseline_gbps`: two plain processes over loopback; one `sendall`s, the other
  `recv_into`s a preallocated buffer (each object into its own place of it, or all into one
  place). What a transport over tcp could reach at best.
- `memcpy_baseline_gbps`: one plain memory copy of the same bytes (the shm transport's ceiling).
- `transport_gbps`: a `TransportServer` with one DRAM segment in a separate process, written
  and read from this one through a `Transport` client.

All return decimal GB/s (1e9 bytes per second). Processes start with the 'spawn' context so
that nothing of the caller (threads, event loop, sockets) leaks into them.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import socket
import struct
import time
from multiprocessing.connection import Connection
from typing import Any

_CTX = mp.get_context("spawn")
_STAMP = struct.Struct("!q")
_TIMEOUT_S = 120.0


def _count(size: int, total_bytes: int) -> int:
    if size <= 0:
        raise ValueError("size must be > 0")
    return max(1, total_bytes // size)


# --- tcp baseline -------------------------------------------------------------------------------


def _receiver(conn: Connection, size: int, count: int, slots: int) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    conn.send(listener.getsockname()[1])
    sock, _ = listener.accept()
    buf = bytearray(b"\x01") * (size * slots)  # touched: no page faults while timed
    views = [memoryview(buf)[i * size : (i + 1) * size] for i in range(slots)]
    stamp = bytearray(_STAMP.size)
    _recv_exact(sock, memoryview(stamp))
    for i in range(count):
        _recv_exact(sock, views[i % slots])
    end = time.monotonic_ns()  # CLOCK_MONOTONIC: one clock for every process on the host
    conn.send(end - _STAMP.unpack(stamp)[0])
    sock.close()
    listener.close()


def _sender(port: int, size: int, count: int, slots: int) -> None:
    sock = socket.create_connection(("127.0.0.1", port))
    data = [os.urandom(size) for _ in range(slots)]
    sock.sendall(_STAMP.pack(time.monotonic_ns()))
    for i in range(count):
        sock.sendall(data[i % slots])
    sock.close()


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("sender closed early")
        got += n


def tcp_baseline_gbps(size: int, total_bytes: int, slots: int = 1) -> float:
    """`slots` distinct objects are sent, each received into its own place of a
    preallocated, pre-touched buffer (as a store batch lands in distinct places of a
    segment); with 1, the same bytes go into one buffer again and again (cache-hot when the
    object fits in the CPU's cache)."""
    count = _count(size, total_bytes)
    slots = max(1, min(slots, count))
    parent, child = _CTX.Pipe()
    recv_proc = _CTX.Process(target=_receiver, args=(child, size, count, slots), daemon=True)
    recv_proc.start()
    try:
        if not parent.poll(_TIMEOUT_S):
            raise TimeoutError("baseline receiver did not start")
        port = parent.recv()
        send_proc = _CTX.Process(target=_sender, args=(port, size, count, slots), daemon=True)
        send_proc.start()
        if not parent.poll(_TIMEOUT_S):
            raise TimeoutError("baseline transfer did not finish")
        elapsed_ns: int = parent.recv()
        send_proc.join(_TIMEOUT_S)
    finally:
        recv_proc.join(5)
        if recv_proc.is_alive():
            recv_proc.kill()
    return size * count / max(elapsed_ns, 1)


# --- memcpy baseline ----------------------------------------------------------------------------


def memcpy_baseline_gbps(size: int, total_bytes: int) -> float:
    count = _count(size, total_bytes)
    src = memoryview(os.urandom(size))
    dst = memoryview(bytearray(size))
    dst[:] = src  # touch the destination pages once, as a segment is pre-touched
    start = time.perf_counter()
    for _ in range(count):
        dst[:] = src
    return size * count / (time.perf_counter() - start) / 1e9


# --- a transport against its own server in another process --------------------------------------


def _serve(name: str, secret: bytes, size: int, conn: Connection, options: dict[str, Any]) -> None:
    asyncio.run(_serve_async(name, secret, size, conn, options))


async def _serve_async(
    name: str, secret: bytes, size: int, conn: Connection, options: dict[str, Any]
) -> None:
    from mooncake.store.segment import Segment
    from mooncake.store.transfer import SegmentTable, make_server

    segment = Segment.create_dram("bench-0", "bench", size)
    table = SegmentTable()
    table.add(segment)
    server = make_server(name, secret=secret, **options)
    await server.start(table)
    try:
        conn.send(server.endpoint("bench-0"))
        await asyncio.to_thread(conn.recv)  # wait for "stop"
    finally:
        await server.stop()
        segment.close()


async def transport_gbps_async(
    name: str,
    size: int,
    total_bytes: int,
    secret: bytes,
    *,
    server_options: dict[str, Any] | None = None,
    client_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    from mooncake.store.transfer import make_client
    from mooncake.store.types import Region

    count = _count(size, total_bytes)
    parent, child = _CTX.Pipe()
    proc = _CTX.Process(
        target=_serve, args=(name, secret, size, child, server_options or {}), daemon=True
    )
    proc.start()
    client = make_client(name, secret=secret, **(client_options or {}))
    try:
        if not await asyncio.to_thread(parent.poll, _TIMEOUT_S):
            raise TimeoutError(f"{name} server did not start")
        endpoint: str = parent.recv()
        region = Region("bench-0", 0, size)
        data = os.urandom(size)
        out = bytearray(size)
        await client.write(endpoint, region, data)  # warm: connections, mappings, pages
        await client.read_into(endpoint, region, out)
        if out != data:
            raise AssertionError(f"{name}: read back differs from what was written")
        start = time.perf_counter()
        for _ in range(count):
            await client.write(endpoint, region, data)
        write_s = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(count):
            await client.read_into(endpoint, region, out)
        read_s = time.perf_counter() - start
    finally:
        await client.close()
        parent.send("stop")
        await asyncio.to_thread(proc.join, 10)
        if proc.is_alive():
            proc.kill()
    moved = size * count
    return {
        "transport": name,
        "size": size,
        "bytes": moved,
        "write_gbps": moved / write_s / 1e9,
        "read_gbps": moved / read_s / 1e9,
    }


def transport_gbps(name: str, size: int, total_bytes: int, secret: bytes) -> dict[str, Any]:
    """Write and read throughput of transport `name` (GB/s) against a server in its own
    process; for callers without an event loop (use `transport_gbps_async` inside one)."""
    return asyncio.run(transport_gbps_async(name, size, total_bytes, secret))


def main() -> None:  # python -m mooncake.bench.store_baselines: a quick table
    secret = os.urandom(32)
    for size in (64 << 10, 1 << 20, 16 << 20):
        total = max(256 << 20, 8 * size)
        tcp = tcp_baseline_gbps(size, total)
        mem = memcpy_baseline_gbps(size, total)
        print(f"{size >> 10:>6} KiB  baseline tcp {tcp:6.2f} GB/s  memcpy {mem:6.2f} GB/s")
        for name, base in (("tcp", tcp), ("shm", mem)):
            r = transport_gbps(name, size, total, secret)
            print(
                f"{'':>10}{name}: write {r['write_gbps']:6.2f} ({r['write_gbps'] / base:4.2f}x)"
                f"  read {r['read_gbps']:6.2f} ({r['read_gbps'] / base:4.2f}x)"
            )


if __name__ == "__main__":
    main()

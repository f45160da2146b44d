"""The shm transport: a client on the same host maps the segment's file and copies in memory.

Endpoint: "<boot id>:<path of the segment's backing file>". The boot id
(/proc/sys/kernel/random/boot_id) tells whether client and server run on the same kernel; on
another host `reaches` is False and the client falls back to tcp or rdma.

Security: there is no server to authenticate against. Access is guarded by the file's mode
(0600: only the node's own user can open it) and by its name, which carries a random 128-bit
token and is handed out only over the authenticated control plane; knowing the name is the
capability. A process of the same user on the same host could map it anyway, which is the same
trust a node already places in its own user.

The server side has nothing to run: it only produces endpoints. The client maps each file
once (MAP_POPULATE, cached) and a transfer is one memory copy; copies larger than 256 KiB run
in worker threads with the GIL released (ctypes.memmove) so the event loop is not held up. A
segment of the client's own process (a worker's embedded store node) is not mapped again:
the copy goes through the segment's own mapping.

A mapping is kept, not made per transfer: copying out of a mapping that is already populated
runs at ~16 GB/s per thread here, where pread/pwrite on the file or a fresh (or madvised)
mapping per copy run at ~6 GB/s. The price is that RSS counts a peer's segment in every
process that maps it (PSS shares it out; see docs/deploy.md).
"""

from __future__ import annotations

import asyncio
import ctypes
import mmap
import os
from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import ClassVar

from mooncake.store.segment import file_holds, own_mapping
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
from mooncake.store.types import Region

# Objects up to this size are copied on the event loop; larger ones go, all of a batch
# together, to one worker thread, so the loop can answer (or send) control messages while
# the bytes move. (A hop per object cost 10-15% of throughput at 16 MiB.)
INLINE_COPY = 256 << 10
# A batch's large copies are split over up to this many threads (memcpy on one core does not
# reach the memory bandwidth: on the 2-core dev box, 2 threads copy ~1.8x as fast as one).
COPY_THREADS = max(1, min(4, os.cpu_count() or 1))
# ... but no thread gets less than this: a thread hop costs more than a small copy.
MIN_BYTES_PER_THREAD = 1 << 20
BOOT_ID_PATH = Path("/proc/sys/kernel/random/boot_id")


@cache
def boot_id() -> str:
    try:
        return BOOT_ID_PATH.read_text().strip()
    except OSError:
        return ""


def available() -> tuple[bool, str]:
    if not boot_id():
        return False, f"cannot read {BOOT_ID_PATH}: no way to tell same-host peers"
    return True, "same-host shared memory"


def parse_endpoint(endpoint: str) -> tuple[str, Path]:
    host, sep, path = endpoint.partition(":")
    if not sep or not host or not path.startswith("/"):
        raise ValueError(f"not an shm endpoint: {endpoint!r}")
    return host, Path(path)


class ShmServer(TransportServer):
    name: ClassVar[str] = "shm"

    def __init__(self, *, secret: bytes) -> None:
        del secret  # nothing to authenticate: see the module docstring
        self._table: SegmentTable | None = None

    async def start(self, table: SegmentTable) -> None:
        self._table = table

    def endpoint(self, segment_id: str) -> str:
        if self._table is None:
            raise RuntimeError("server not started")
        return f"{boot_id()}:{self._table.get(segment_id).path}"

    async def stop(self) -> None:
        self._table = None


class _Mapping:
    def __init__(self, path: Path) -> None:
        own = own_mapping(path)
        if own is not None:  # our own segment: its mapping is ours to borrow, not to close
            self.mm, self._owned = own, False
        else:
            self.mm, self._owned = self._map(path), True
        self.view = memoryview(self.mm)
        self.size = len(self.mm)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))

    @staticmethod
    def _map(path: Path) -> mmap.mmap:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            raise TransferError("unknown_segment", f"{path} does not exist") from None
        except OSError as exc:
            raise TransferError("unreachable", f"cannot open {path}: {exc}") from exc
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise TransferError("unknown_segment", f"{path} is empty")
            flags = mmap.MAP_SHARED | mmap.MAP_POPULATE
            return mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)

    def close(self) -> None:
        self.view.release()
        if not self._owned:
            return
        try:
            self.mm.close()
        except BufferError:
            pass  # a copy in flight still holds it; the mapping goes with the last reference


class ShmTransport(Transport):
    name: ClassVar[str] = "shm"

    def __init__(
        self, *, secret: bytes, inline_copy: int = INLINE_COPY, copy_threads: int = COPY_THREADS
    ) -> None:
        del secret
        self._maps: dict[Path, _Mapping] = {}
        self._resolved: dict[tuple[str, str], _Mapping] = {}  # checked (endpoint, segment id)
        self._inline = inline_copy
        self._threads = max(1, copy_threads)

    def reaches(self, endpoint: str) -> bool:
        try:
            host, _ = parse_endpoint(endpoint)
        except ValueError:
            return False
        return bool(host) and host == boot_id()

    def _mapping(self, endpoint: str, region: Region) -> _Mapping:
        mapping = self._resolved.get((endpoint, region.segment_id))
        if mapping is None:
            mapping = self._resolve(endpoint, region.segment_id)
        check_bounds(region.offset, region.length, mapping.size)
        return mapping

    def _resolve(self, endpoint: str, segment_id: str) -> _Mapping:
        try:
            host, path = parse_endpoint(endpoint)
        except ValueError as exc:
            raise TransferError("bad_request", str(exc)) from None
        if host != boot_id():
            raise TransferError("unreachable", f"{endpoint!r} is on another host")
        if not file_holds(path.name, segment_id):
            raise TransferError("unknown_segment", f"{segment_id!r} is not at {endpoint!r}")
        mapping = self._maps.get(path)
        if mapping is None:
            mapping = self._maps[path] = _Mapping(path)
        self._resolved[(endpoint, segment_id)] = mapping
        return mapping

    async def write(self, endpoint: str, region: Region, data: Buffer) -> None:
        await self._copy(endpoint, ((region, data),), to_segment=True)

    async def read_into(self, endpoint: str, region: Region, out: Buffer) -> None:
        await self._copy(endpoint, ((region, out),), to_segment=False)

    async def write_many(self, endpoint: str, ops: Sequence[tuple[Region, Buffer]]) -> None:
        await self._copy(endpoint, ops, to_segment=True)

    async def read_many(self, endpoint: str, ops: Sequence[tuple[Region, Buffer]]) -> None:
        await self._copy(endpoint, ops, to_segment=False)

    async def _copy(
        self, endpoint: str, ops: Sequence[tuple[Region, Buffer]], *, to_segment: bool
    ) -> None:
        plan = []  # validate everything before the first byte moves
        for region, buf in ops:
            view = as_memoryview(buf, writable=not to_segment)
            check_length(region, view)
            plan.append((self._mapping(endpoint, region), region, view))
        moves: list[tuple[int, int, int]] = []
        alive: list[memoryview] = []  # the segment slices and buffers the moves point into
        for mapping, region, view in plan:
            seg = mapping.view[region.offset : region.offset + region.length]
            if region.length <= self._inline:
                if to_segment:
                    seg[:] = view
                else:
                    view[:] = seg
                continue
            seg_addr = mapping.address + region.offset
            buf_addr = _address(view)
            dst, src = (seg_addr, buf_addr) if to_segment else (buf_addr, seg_addr)
            moves.append((dst, src, region.length))
            alive += (seg, view)
        if moves:
            # Worker threads (memmove through ctypes releases the GIL): the event loop goes
            # on meanwhile. One hop per thread for the whole batch, not one per object.
            total = sum(n for _, _, n in moves)
            parts = max(1, min(self._threads, total // MIN_BYTES_PER_THREAD))
            await asyncio.gather(
                *(asyncio.to_thread(_memmove_all, part) for part in split_moves(moves, parts))
            )
        del alive

    async def close(self) -> None:
        for mapping in self._maps.values():
            mapping.close()
        self._maps.clear()
        self._resolved.clear()


Move = tuple[int, int, int]  # (destination address, source address, bytes)


def split_moves(moves: Sequence[Move], parts: int) -> list[list[Move]]:
    """Cut a list of copies into `parts` runs of (nearly) equal bytes, in order; a copy that
    straddles a boundary is cut in two. Every byte is copied exactly once."""
    total = sum(n for _, _, n in moves)
    parts = max(1, min(parts, total))
    if parts == 1:
        return [list(moves)]
    share, extra = divmod(total, parts)
    out: list[list[Move]] = [[] for _ in range(parts)]
    k, room = 0, share + (extra > 0)
    for dst, src, n in moves:
        while n > 0:
            take = min(n, room)
            out[k].append((dst, src, take))
            dst, src, n, room = dst + take, src + take, n - take, room - take
            if room == 0 and k + 1 < parts:
                k += 1
                room = share + (k < extra)
    return out


def _memmove_all(moves: list[Move]) -> None:
    for dst, src, n in moves:
        ctypes.memmove(dst, src, n)


def _address(view: memoryview) -> int:
    if view.readonly:  # bytes and friends: no writable export, ask numpy for the pointer
        import numpy as np

        addr: int = np.frombuffer(view, dtype=np.uint8).ctypes.data
        return addr
    return ctypes.addressof(ctypes.c_char.from_buffer(view))

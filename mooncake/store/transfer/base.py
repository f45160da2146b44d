"""The one contract every transport honours, and what they share.

A node runs one `TransportServer` per transport over its `SegmentTable`; `endpoint()` gives
the address that goes into `SegmentInfo.endpoints[name]`. A client holds one `Transport` per
transport and moves bytes between its own buffers and a `Region` of a remote segment. Data
buffers are anything that exposes contiguous memory (bytes, bytearray, memoryview, numpy
arrays, CPU torch tensors); `read_into` fills the caller's buffer in place.
"""

from __future__ import annotations

import importlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal

from mooncake.store.segment import Segment
from mooncake.store.types import Region

Buffer = Any  # bytes | bytearray | memoryview | numpy.ndarray | torch.Tensor (see as_memoryview)

ErrorReason = Literal[
    "auth",
    "out_of_bounds",
    "unknown_segment",
    "bad_request",
    "connection",
    "unreachable",
    "unavailable",
]
REASONS: tuple[ErrorReason, ...] = (
    "auth",
    "out_of_bounds",
    "unknown_segment",
    "bad_request",
    "connection",
    "unreachable",
    "unavailable",
)


class TransferError(Exception):
    """A transfer failed; `reason` says why (one of `REASONS`)."""

    def __init__(self, reason: ErrorReason, message: str = "") -> None:
        super().__init__(f"{reason}: {message}" if message else reason)
        self.reason: ErrorReason = reason
        self.detail = message


class SegmentTable:
    """Server side: the segments a node serves. Thread-safe (servers resolve from threads)."""

    def __init__(self) -> None:
        self._segments: dict[str, Segment] = {}
        self._lock = threading.Lock()
        self._watchers: list[Callable[[str, Segment], None]] = []

    def add(self, segment: Segment) -> None:
        with self._lock:
            if segment.info.segment_id in self._segments:
                raise ValueError(f"segment {segment.info.segment_id!r} already in the table")
            self._segments[segment.info.segment_id] = segment
        for watcher in list(self._watchers):
            watcher("add", segment)

    def remove(self, segment_id: str) -> None:
        """Stop serving a segment; call before closing it (rdma deregisters its memory here)."""
        with self._lock:
            segment = self._segments.pop(segment_id, None)
        if segment is not None:
            for watcher in list(self._watchers):
                watcher("remove", segment)

    def watch(self, callback: Callable[[str, Segment], None]) -> Callable[[], None]:
        """Call `callback("add" | "remove", segment)` on every change; returns an unwatch."""
        self._watchers.append(callback)
        return lambda: self._watchers.remove(callback) if callback in self._watchers else None

    def get(self, segment_id: str) -> Segment:
        try:
            return self._segments[segment_id]
        except KeyError:
            raise TransferError("unknown_segment", repr(segment_id)) from None

    def segments(self) -> list[Segment]:
        with self._lock:
            return list(self._segments.values())

    def resolve(self, region: Region) -> memoryview:
        """The bytes of `region`, bounds-checked: never a view outside a registered segment."""
        segment = self.get(region.segment_id)
        check_bounds(region.offset, region.length, segment.info.size)
        return segment.buf[region.offset : region.offset + region.length]


def check_bounds(offset: int, length: int, size: int) -> None:
    if offset < 0 or length < 0 or offset > size or length > size - offset:
        raise TransferError("out_of_bounds", f"{offset}+{length} outside 0..{size}")


def as_memoryview(obj: Buffer, *, writable: bool) -> memoryview:
    """A flat, byte-format view of `obj` without copying; TypeError/ValueError if impossible."""
    kind = type(obj)
    if kind is bytearray or (kind is bytes and not writable):  # the common case, fast
        return memoryview(obj)
    if _is_torch_tensor(obj):
        if obj.device.type != "cpu":
            raise ValueError(f"tensor on {obj.device} is not host memory; copy it to cpu first")
        if not obj.is_contiguous():
            raise ValueError("tensor is not contiguous")
        if obj.requires_grad:
            obj = obj.detach()
        obj = obj.numpy()  # shares the storage; fails for dtypes numpy lacks (bfloat16)
    try:
        view = memoryview(obj)
    except TypeError:
        raise TypeError(f"{type(obj).__name__} does not expose a buffer") from None
    if writable and view.readonly:
        raise TypeError(f"{type(obj).__name__} is read-only; read_into needs a writable buffer")
    if not view.c_contiguous:
        raise ValueError("buffer is not C-contiguous")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    return view


def _is_torch_tensor(obj: object) -> bool:
    module = type(obj).__module__
    if not module.startswith("torch"):
        return False
    import torch

    return isinstance(obj, torch.Tensor)


def check_length(region: Region, view: memoryview) -> None:
    if view.nbytes != region.length:
        raise TransferError(
            "bad_request", f"buffer of {view.nbytes} B for a region of {region.length} B"
        )


class TransportServer(ABC):
    """One per node per transport: serves the node's `SegmentTable`."""

    name: ClassVar[str]

    @abstractmethod
    async def start(self, table: SegmentTable) -> None: ...

    @abstractmethod
    def endpoint(self, segment_id: str) -> str: ...

    @abstractmethod
    async def stop(self) -> None: ...


class Transport(ABC):
    """Client side: moves bytes between the caller's buffers and remote regions."""

    name: ClassVar[str]

    @abstractmethod
    def reaches(self, endpoint: str) -> bool: ...

    @abstractmethod
    async def write(self, endpoint: str, region: Region, data: Buffer) -> None: ...

    @abstractmethod
    async def read_into(self, endpoint: str, region: Region, out: Buffer) -> None: ...

    async def write_many(self, endpoint: str, ops: Sequence[tuple[Region, Buffer]]) -> None:
        for region, data in ops:
            await self.write(endpoint, region, data)

    async def read_many(self, endpoint: str, ops: Sequence[tuple[Region, Buffer]]) -> None:
        for region, out in ops:
            await self.read_into(endpoint, region, out)

    @abstractmethod
    async def close(self) -> None: ...


# name -> "module:ServerClass:ClientClass:availability function"; imported on first use so that
# `import mooncake.store.transfer` never pulls pyverbs (or anything heavy) in.
_REGISTRY: dict[str, tuple[str, str, str, str]] = {
    "tcp": ("mooncake.store.transfer.tcp", "TcpServer", "TcpTransport", "available"),
    "shm": ("mooncake.store.transfer.shm", "ShmServer", "ShmTransport", "available"),
    "rdma": ("mooncake.store.transfer.rdma", "RdmaServer", "RdmaTransport", "available"),
}
NAMES: tuple[str, ...] = tuple(_REGISTRY)


def _member(name: str, index: int) -> Any:
    try:
        entry = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown transport {name!r}; known: {', '.join(NAMES)}") from None
    return getattr(importlib.import_module(entry[0]), entry[index])


def make_server(name: str, *, secret: bytes, **options: Any) -> TransportServer:
    cls: Callable[..., TransportServer] = _member(name, 1)
    return cls(secret=secret, **options)


def make_client(name: str, *, secret: bytes, **options: Any) -> Transport:
    cls: Callable[..., Transport] = _member(name, 2)
    return cls(secret=secret, **options)


def available(name: str) -> tuple[bool, str]:
    """Whether transport `name` can be used on this host, and why not if it cannot."""
    check: Callable[[], tuple[bool, str]] = _member(name, 3)
    return check()

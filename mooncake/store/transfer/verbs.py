"""A thin adapter over the verbs calls the rdma transport needs, and a fake of it for tests.

`VerbsContext` opens one device (protection domain included), registers memory regions over
buffers that already exist (segments, staging buffers) and creates reliable-connected queue
pairs, each with its own completion queue. A `VerbsQp` reports the info its peer needs
(lid / gid / qpn / psn), moves INIT -> RTR -> RTS once given the peer's info, posts one-sided
RDMA READ / WRITE work requests (remote address + rkey) and polls for completions.

`PyverbsContext` implements it with pyverbs (imported lazily: Debian ships it for the system
interpreter only, and no device exists on most development machines). `FakeFabric` is an
in-memory network of `FakeContext`s for tests: READ and WRITE copy between registered buffers
of the same process and check keys, bounds and queue-pair state like a device would, failing
the completion (and moving the QP to the error state) on a violation.
"""

from __future__ import annotations

import ctypes
import itertools
import random
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

ACCESS_ERROR = "remote access error"
FLUSHED = "work request flushed (queue pair in error state)"


@dataclass(frozen=True, slots=True)
class QpInfo:
    lid: int
    gid: str
    qpn: int
    psn: int


@dataclass(frozen=True, slots=True)
class MemoryRegion:
    addr: int
    length: int
    lkey: int
    rkey: int


@dataclass(frozen=True, slots=True)
class Completion:
    wr_id: int
    ok: bool
    status: str = "success"


class VerbsQp(Protocol):
    def info(self) -> QpInfo: ...

    def connect(self, remote: QpInfo) -> None: ...

    def post_read(
        self,
        wr_id: int,
        local: MemoryRegion,
        local_addr: int,
        length: int,
        remote_addr: int,
        rkey: int,
    ) -> None: ...

    def post_write(
        self,
        wr_id: int,
        local: MemoryRegion,
        local_addr: int,
        length: int,
        remote_addr: int,
        rkey: int,
    ) -> None: ...

    def poll(self, max_entries: int) -> list[Completion]: ...

    def close(self) -> None: ...


class VerbsContext(Protocol):
    device: str

    def register(self, buf: memoryview) -> MemoryRegion: ...

    def deregister(self, mr: MemoryRegion) -> None: ...

    def create_qp(self, depth: int) -> VerbsQp: ...

    def close(self) -> None: ...


def buffer_address(buf: memoryview) -> int:
    if buf.readonly:
        raise ValueError("only writable memory can be registered")
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


# --- pyverbs -------------------------------------------------------------------------------------


def pyverbs_status() -> tuple[bool, str]:
    """Whether pyverbs imports here and sees at least one RDMA device (and why not)."""
    try:
        import pyverbs.device as dev
    except ImportError as exc:
        return False, f"pyverbs is not importable in this interpreter ({exc})"
    try:
        devices = dev.get_device_list()
    except Exception as exc:  # pyverbs raises its own error types when verbs are unusable
        return False, f"cannot list RDMA devices: {exc}"
    if not devices:
        return False, "pyverbs imports but no RDMA device exists on this host"
    names = ", ".join(
        d.name.decode() if isinstance(d.name, bytes) else str(d.name) for d in devices
    )
    return True, f"RDMA devices: {names}"


def _enum(name: str) -> Any:
    """A verbs constant by its C name, across pyverbs versions (module or enum class level)."""
    import importlib

    for module in ("pyverbs.libibverbs_enums", "pyverbs.enums"):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        if hasattr(mod, name):
            return getattr(mod, name)
        for attr in vars(mod).values():
            if isinstance(attr, type) and hasattr(attr, name):
                return getattr(attr, name)
    raise LookupError(f"verbs constant {name} not found in pyverbs")


class PyverbsContext:
    """`VerbsContext` over pyverbs: one device, one port, one PD."""

    def __init__(self, device: str | None = None, *, port: int = 1, gid_index: int = 0) -> None:
        import pyverbs.device as dev
        from pyverbs.pd import PD

        if device is None:
            devices = dev.get_device_list()
            if not devices:
                raise RuntimeError("no RDMA device")
            raw = devices[0].name
            device = raw.decode() if isinstance(raw, bytes) else str(raw)
        self.device = device
        self._port = port
        self._gid_index = gid_index
        self._ctx = dev.Context(name=device)
        self._pd = PD(self._ctx)
        self._lid = self._ctx.query_port(port).lid
        self._gid = str(self._ctx.query_gid(port, gid_index))
        self._mrs: dict[int, Any] = {}
        self._access = (
            _enum("IBV_ACCESS_LOCAL_WRITE")
            | _enum("IBV_ACCESS_REMOTE_READ")
            | _enum("IBV_ACCESS_REMOTE_WRITE")
        )

    def register(self, buf: memoryview) -> MemoryRegion:
        from pyverbs.mr import MR

        addr = buffer_address(buf)
        mr = MR(self._pd, buf.nbytes, self._access, address=addr)
        self._mrs[mr.lkey] = (mr, buf)  # the view keeps the memory mapped while registered
        return MemoryRegion(addr, buf.nbytes, mr.lkey, mr.rkey)

    def deregister(self, mr: MemoryRegion) -> None:
        entry = self._mrs.pop(mr.lkey, None)
        if entry is not None:
            entry[0].close()

    def create_qp(self, depth: int) -> VerbsQp:
        return _PyverbsQp(self, depth)

    def close(self) -> None:
        for mr, _ in self._mrs.values():
            mr.close()
        self._mrs.clear()
        self._pd.close()
        self._ctx.close()


class _PyverbsQp:
    def __init__(self, owner: PyverbsContext, depth: int) -> None:
        from pyverbs.cq import CQ
        from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr

        self._owner = owner
        self._cq = CQ(owner._ctx, depth * 2)
        cap = QPCap(max_send_wr=depth, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = QPInitAttr(qp_type=_enum("IBV_QPT_RC"), scq=self._cq, rcq=self._cq, cap=cap)
        attr = QPAttr(port_num=owner._port)
        attr.qp_access_flags = owner._access
        self._qp = QP(owner._pd, init, attr)  # created straight into INIT
        self._psn = random.getrandbits(24)

    def info(self) -> QpInfo:
        return QpInfo(self._owner._lid, self._owner._gid, self._qp.qp_num, self._psn)

    def connect(self, remote: QpInfo) -> None:
        from pyverbs.addr import GID, AHAttr, GlobalRoute
        from pyverbs.qp import QPAttr

        attr = QPAttr(port_num=self._owner._port, path_mtu=_enum("IBV_MTU_1024"))
        attr.qp_access_flags = self._owner._access
        attr.dest_qp_num = remote.qpn
        attr.rq_psn = remote.psn
        attr.sq_psn = self._psn
        attr.max_dest_rd_atomic = 16
        attr.max_rd_atomic = 16
        attr.min_rnr_timer = 12
        attr.timeout = 14
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        route = GlobalRoute(dgid=GID(remote.gid), sgid_index=self._owner._gid_index)
        attr.ah_attr = AHAttr(port_num=self._owner._port, is_global=1, gr=route, dlid=remote.lid)
        self._qp.to_rts(attr)  # INIT -> RTR -> RTS

    def _post(
        self,
        opcode: str,
        wr_id: int,
        local: MemoryRegion,
        local_addr: int,
        length: int,
        remote_addr: int,
        rkey: int,
    ) -> None:
        from pyverbs.wr import SGE, SendWR

        sge = SGE(local_addr, length, local.lkey)
        wr = SendWR(wr_id=wr_id, opcode=_enum(opcode), num_sge=1, sg=[sge])
        wr.set_wr_rdma(rkey, remote_addr)
        self._qp.post_send(wr)

    def post_read(
        self,
        wr_id: int,
        local: MemoryRegion,
        local_addr: int,
        length: int,
        remote_addr: int,
        rkey: int,
    ) -> None:
        self._post("IBV_WR_RDMA_READ", wr_id, local, local_addr, length, remote_addr, rkey)

    def post_write(
        self,
        wr_id: int,
        local: MemoryRegion,
        local_addr: int,
        length: int,
        remote_addr: int,
        rkey: int,
    ) -> None:
        self._post("IBV_WR_RDMA_WRITE", wr_id, local, local_addr, length, remote_addr, rkey)

    def poll(self, max_entries: int) -> list[Completion]:
        n, wcs = self._cq.poll(max_entries)
        success = _enum("IBV_WC_SUCCESS")
        return [
            Completion(wc.wr_id, wc.status == success, f"wc status {wc.status}") for wc in wcs[:n]
        ]

    def close(self) -> None:
        self._qp.close()
        self._cq.close()


# --- fake -----------------------------------------------------------------------------------------


@dataclass
class FakeFabric:
    """An in-process 'network': routes queue pairs by number and memory by key."""

    qps: dict[int, FakeQp] = field(default_factory=dict)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(0x100))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def context(self, device: str = "fake0") -> FakeContext:
        return FakeContext(self, device)

    def next_id(self) -> int:
        with self.lock:
            return next(self._ids)


class FakeContext:
    def __init__(self, fabric: FakeFabric, device: str) -> None:
        self.fabric = fabric
        self.device = device
        self.gid = f"fe80::{fabric.next_id():x}"
        self.mrs: dict[int, tuple[MemoryRegion, memoryview]] = {}  # by rkey (== lkey here)
        self.qps: list[FakeQp] = []

    def register(self, buf: memoryview) -> MemoryRegion:
        key = self.fabric.next_id()
        mr = MemoryRegion(buffer_address(buf), buf.nbytes, key, key)
        self.mrs[key] = (mr, buf)
        return mr

    def deregister(self, mr: MemoryRegion) -> None:
        self.mrs.pop(mr.rkey, None)

    def create_qp(self, depth: int) -> VerbsQp:
        qp = FakeQp(self, depth)
        self.qps.append(qp)
        return qp

    def close(self) -> None:
        for qp in list(self.qps):
            qp.close()
        self.mrs.clear()

    def covers(self, key: int, addr: int, length: int) -> bool:
        entry = self.mrs.get(key)
        if entry is None:
            return False
        mr = entry[0]
        return mr.addr <= addr and addr + length <= mr.addr + mr.length and length >= 0


class FakeQp:
    def __init__(self, ctx: FakeContext, depth: int) -> None:
        self.ctx = ctx
        self.depth = depth
        self.qpn = ctx.fabric.next_id()
        self.psn = random.getrandbits(24)
        self.state = "INIT"
        self.remote: FakeQp | None = None
        self.cq: deque[Completion] = deque()
        self.outstanding = 0
        ctx.fabric.qps[self.qpn] = self

    def info(self) -> QpInfo:
        return QpInfo(0, self.ctx.gid, self.qpn, self.psn)

    def connect(self, remote: QpInfo) -> None:
        if self.state != "INIT":
            raise RuntimeError(f"connect in state {self.state}")
        peer = self.ctx.fabric.qps.get(remote.qpn)
        if peer is None or peer.ctx.gid != remote.gid:
            raise RuntimeError(f"no queue pair {remote.qpn} at {remote.gid}")
        self.remote = peer
        self.state = "RTS"  # INIT -> RTR -> RTS

    def post_read(
        self,
        wr_id: int,
        local: MemoryRegion,
        local_addr: int,
        length: int,
        remote_addr: int,
        rkey: int,
    ) -> None:
        self._post(wr_id, local, local_addr, length, remote_addr, rkey, read=True)

    def post_write(
        self,
        wr_id: int,
        local: MemoryRegion,
        local_addr: int,
        length: int,
        remote_addr: int,
        rkey: int,
    ) -> None:
        self._post(wr_id, local, local_addr, length, remote_addr, rkey, read=False)

    def _post(
        self,
        wr_id: int,
        local: MemoryRegion,
        local_addr: int,
        length: int,
        remote_addr: int,
        rkey: int,
        *,
        read: bool,
    ) -> None:
        if self.state not in ("RTS", "ERR"):
            raise RuntimeError(f"post_send in state {self.state}")
        if self.outstanding >= self.depth:
            raise RuntimeError("send queue full")
        self.outstanding += 1
        if self.state == "ERR":
            self.cq.append(Completion(wr_id, False, FLUSHED))
            return
        remote = self.remote
        if (
            remote is None
            or remote.state != "RTS"
            or not self.ctx.covers(local.lkey, local_addr, length)
            or not remote.ctx.covers(rkey, remote_addr, length)
        ):
            self.state = "ERR"
            self.cq.append(Completion(wr_id, False, ACCESS_ERROR))
            return
        dst, src = (local_addr, remote_addr) if read else (remote_addr, local_addr)
        ctypes.memmove(dst, src, length)
        self.cq.append(Completion(wr_id, True))

    def poll(self, max_entries: int) -> list[Completion]:
        out: list[Completion] = []
        while self.cq and len(out) < max_entries:
            out.append(self.cq.popleft())
        self.outstanding -= len(out)
        return out

    def close(self) -> None:
        self.state = "CLOSED"
        self.ctx.fabric.qps.pop(self.qpn, None)
        if self in self.ctx.qps:
            self.ctx.qps.remove(self)

"""Activations between the stages of a chunked pipeline, over the store's transfer engine
(tcp, shm or rdma; never NATS, whose messages cap at 1 MiB and ~1 GB/s).

The receiving stage holds an `Inbox`: a ring of `slots` slots in one of its own segments,
served by its `TransportServer` like any store segment. The sending stage's `Outbox` writes
into it with one-sided writes only, as RDMA does: a chunk's bytes into slot `seq % slots`,
then the slot's header (its sequence number, byte count, shape and dtype), then the ring's
`written` counter, each write complete before the next starts, so a receiver that sees the
counter sees the bytes. The receiver copies a chunk out and advances `consumed` in its own
segment; the sender reads that counter (one-sided) before it reuses a slot, so a slow
receiver holds the sender back instead of being overwritten.

Layout of the inbox segment: [written u64][consumed u64], padded to 64 bytes, then the slots,
each a 64-byte header [seq u64][nbytes u64][rows u64][cols u64][dtype u64] and its bytes.
"""

from __future__ import annotations

import asyncio
import struct
import time

import torch
from torch import Tensor

from mooncake.store.segment import Segment
from mooncake.store.transfer import Transport
from mooncake.store.types import Region

RING = struct.Struct("<QQ")  # written, consumed
RING_BYTES = 64
SLOT = struct.Struct("<QQQQQ")  # seq, nbytes, rows, cols, dtype code
SLOT_HEADER = 64
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Waits poll: every POLL_S at first, backing off to POLL_MAX_S. A chunk of a long prefill
# takes 100s-1000s of ms, so a few ms late is nothing, while a stage that waits seconds
# for its first chunk (the pipeline's fill) polling every 0.5 ms took CPU from the one
# computing it on a machine of two cores.
POLL_S = 0.0005
POLL_MAX_S = 0.005


def _backoff(wait: float) -> float:
    return min(wait * 1.5, POLL_MAX_S)


class Aborted(Exception):
    """The pipeline was given up (`abort` set) while a stage waited on its inbox or outbox."""


def _check(abort: asyncio.Event | None) -> None:
    if abort is not None and abort.is_set():
        raise Aborted("the pipeline was given up")


def slot_bytes(max_rows: int, cols: int, itemsize: int = 4) -> int:
    return SLOT_HEADER + max_rows * cols * itemsize


def inbox_bytes(slots: int, max_rows: int, cols: int, itemsize: int = 4) -> int:
    """The segment size an inbox of `slots` chunks of up to `max_rows` x `cols` needs."""
    return RING_BYTES + slots * slot_bytes(max_rows, cols, itemsize)


class Inbox:
    """The receiving side, over `segment` (which this process serves)."""

    def __init__(self, segment: Segment, slots: int, slot_size: int) -> None:
        if RING_BYTES + slots * slot_size > segment.info.size:
            raise ValueError("the segment is smaller than the ring")
        self.segment, self.slots, self.slot_size = segment, slots, slot_size
        self.received = 0
        RING.pack_into(segment.buf, 0, 0, 0)

    async def receive(self, timeout_s: float = 600.0, abort: asyncio.Event | None = None) -> Tensor:
        """The next chunk [rows, cols] (a copy: its slot is free again once this returns);
        `Aborted` once `abort` is set."""
        buf, want = self.segment.buf, self.received + 1
        deadline = time.monotonic() + timeout_s
        wait = POLL_S
        while RING.unpack_from(buf, 0)[0] < want:
            _check(abort)
            if time.monotonic() > deadline:
                raise TimeoutError(f"no chunk {want} within {timeout_s:g} s")
            await asyncio.sleep(wait)
            wait = _backoff(wait)
        at = RING_BYTES + (self.received % self.slots) * self.slot_size
        seq, nbytes, rows, cols, code = SLOT.unpack_from(buf, at)
        if seq != want or nbytes > self.slot_size - SLOT_HEADER or code >= len(DTYPES):
            raise ValueError(f"slot for chunk {want} holds a bad header (seq {seq})")
        raw = torch.frombuffer(buf, dtype=torch.uint8, count=nbytes, offset=at + SLOT_HEADER)
        chunk = raw.clone().view(DTYPES[code]).reshape(rows, cols)
        self.received = want
        struct.pack_into("<Q", buf, 8, want)  # `consumed`: the sender may reuse the slot
        return chunk


class Outbox:
    """The sending side: writes into the inbox `segment_id` at `endpoint` through `transport`."""

    def __init__(
        self, transport: Transport, endpoint: str, segment_id: str, slots: int, slot_size: int
    ) -> None:
        self.transport, self.endpoint, self.segment_id = transport, endpoint, segment_id
        self.slots, self.slot_size = slots, slot_size
        self.sent = 0
        self._consumed = bytearray(8)

    def _region(self, offset: int, length: int) -> Region:
        return Region(self.segment_id, offset, length)

    async def send(
        self, x: Tensor, timeout_s: float = 600.0, abort: asyncio.Event | None = None
    ) -> None:
        """Chunk `x` (any shape, its last dimension the columns) to the inbox, once a slot is
        free there; `Aborted` once `abort` is set."""
        flat = x.detach().to("cpu").contiguous().reshape(-1, x.shape[-1])
        data = flat.view(torch.uint8).reshape(-1)  # any dtype, byte for byte
        if data.numel() > self.slot_size - SLOT_HEADER:
            raise ValueError(f"a chunk of {data.numel()} bytes does not fit a slot")
        seq = self.sent + 1
        deadline, wait = time.monotonic() + timeout_s, POLL_S
        while seq - self._read_consumed(await self._fetch_consumed()) > self.slots:
            _check(abort)
            if time.monotonic() > deadline:
                raise TimeoutError(f"the receiver took no chunk within {timeout_s:g} s")
            await asyncio.sleep(wait)
            wait = _backoff(wait)
        at = RING_BYTES + (self.sent % self.slots) * self.slot_size
        code = DTYPES.index(flat.dtype)
        header = SLOT.pack(seq, data.numel(), flat.shape[0], flat.shape[1], code)
        await self.transport.write(self.endpoint, self._region(at + SLOT_HEADER, data.numel()),
                                   data)  # fmt: skip
        await self.transport.write(self.endpoint, self._region(at, SLOT.size), header)
        await self.transport.write(self.endpoint, self._region(0, 8), struct.pack("<Q", seq))
        self.sent = seq

    async def _fetch_consumed(self) -> bytearray:
        await self.transport.read_into(self.endpoint, self._region(8, 8), self._consumed)
        return self._consumed

    @staticmethod
    def _read_consumed(raw: bytearray) -> int:
        return int(struct.unpack("<Q", raw)[0])

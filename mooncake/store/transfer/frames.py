"""The tcp transport's wire format: pure encode/decode with validation (no I/O), fuzzable.

Every message starts with a fixed 24-byte header (network byte order):

    magic "MCTX" | version u8 | op u8 | status u16 | request id u64 | count u32 | body length u32

Requests (WRITE, READ) carry `count` op descriptors in the body, each

    segment id length u8 | offset u64 | length u64 | segment id (utf-8)

and a WRITE is followed by the concatenated data of all ops (the *payload*). A REPLY echoes the
request id and count; `status` is 0 for success, otherwise the 1-based index of the reason in
`REASONS`, with a utf-8 message as its body. A successful READ reply is followed by the
concatenated data of all ops. One frame with many descriptors is how a batch of small reads
costs one round trip.

Anything malformed raises `FrameError` and nothing else: a server logs it and drops the
connection (after the framing is lost, nothing later on the stream can be trusted).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

from mooncake.store.transfer.base import REASONS, ErrorReason
from mooncake.store.types import Region

MAGIC = b"MCTX"
VERSION = 1
HEADER = struct.Struct("!4sBBHQII")
OP_DESC = struct.Struct("!BQQ")
HEADER_SIZE = HEADER.size

MAX_OPS = 4096  # descriptors in one frame
MAX_SEGMENT_ID = 255  # utf-8 bytes
MAX_BODY = MAX_OPS * (OP_DESC.size + MAX_SEGMENT_ID)
MAX_PAYLOAD = 1 << 30  # bytes of data following one frame; clients slice larger transfers
MAX_MESSAGE = 4096  # error text in a reply
MAX_OFFSET = 1 << 62  # offsets and lengths beyond this are nonsense, whatever the segment


class FrameError(Exception):
    """A frame that violates the format; the connection it came on cannot be trusted."""


class Op(IntEnum):
    WRITE = 1
    READ = 2
    REPLY = 3


@dataclass(frozen=True, slots=True)
class Header:
    op: Op
    status: int
    request_id: int
    count: int
    body_len: int


def encode_header(header: Header) -> bytes:
    return HEADER.pack(
        MAGIC,
        VERSION,
        header.op,
        header.status,
        header.request_id,
        header.count,
        header.body_len,
    )


def decode_header(data: bytes | bytearray | memoryview) -> Header:
    if len(data) != HEADER_SIZE:
        raise FrameError(f"header of {len(data)} bytes, expected {HEADER_SIZE}")
    magic, version, op, status, request_id, count, body_len = HEADER.unpack(data)
    if magic != MAGIC:
        raise FrameError(f"bad magic {bytes(magic)!r}")
    if version != VERSION:
        raise FrameError(f"unsupported version {version}")
    try:
        kind = Op(op)
    except ValueError:
        raise FrameError(f"unknown op {op}") from None
    if count > MAX_OPS:
        raise FrameError(f"{count} ops in one frame (max {MAX_OPS})")
    if kind is Op.REPLY:
        if status > len(REASONS):
            raise FrameError(f"unknown status {status}")
        if body_len > MAX_MESSAGE:
            raise FrameError(f"reply body of {body_len} bytes")
    else:
        if status != 0:
            raise FrameError("a request must have status 0")
        if count == 0:
            raise FrameError("a request needs at least one op")
        if body_len > MAX_BODY or body_len < count * (OP_DESC.size + 1):
            raise FrameError(f"body of {body_len} bytes cannot hold {count} ops")
    return Header(kind, status, request_id, count, body_len)


def encode_request(op: Op, request_id: int, regions: Sequence[Region]) -> bytes:
    """Header and body of a WRITE or READ of `regions` (the payload is sent separately)."""
    if op is Op.REPLY:
        raise ValueError("use encode_reply for replies")
    if not 0 < len(regions) <= MAX_OPS:
        raise ValueError(f"{len(regions)} ops in one frame (1..{MAX_OPS})")
    parts = []
    total = 0
    for region in regions:
        sid = region.segment_id.encode()
        if not 0 < len(sid) <= MAX_SEGMENT_ID:
            raise ValueError(f"segment id of {len(sid)} bytes")
        if not (0 <= region.offset <= MAX_OFFSET and 0 <= region.length <= MAX_OFFSET):
            raise ValueError(f"region {region} out of range")
        total += region.length
        parts.append(OP_DESC.pack(len(sid), region.offset, region.length))
        parts.append(sid)
    if total > MAX_PAYLOAD:
        raise ValueError(f"payload of {total} bytes in one frame (max {MAX_PAYLOAD})")
    body = b"".join(parts)
    return encode_header(Header(op, 0, request_id, len(regions), len(body))) + body


def decode_ops(header: Header, body: bytes | bytearray | memoryview) -> list[Region]:
    """The regions of a request whose header is `header` and body `body`."""
    if len(body) != header.body_len:
        raise FrameError(f"body of {len(body)} bytes, header says {header.body_len}")
    view = memoryview(body)
    regions = []
    pos = 0
    total = 0
    for _ in range(header.count):
        if pos + OP_DESC.size > len(view):
            raise FrameError("truncated op descriptor")
        sid_len, offset, length = OP_DESC.unpack_from(view, pos)
        pos += OP_DESC.size
        if sid_len == 0 or pos + sid_len > len(view):
            raise FrameError("bad segment id length")
        try:
            sid = bytes(view[pos : pos + sid_len]).decode()
        except UnicodeDecodeError:
            raise FrameError("segment id is not utf-8") from None
        pos += sid_len
        if offset > MAX_OFFSET or length > MAX_OFFSET:
            raise FrameError(f"offset {offset} / length {length} out of range")
        total += length
        if total > MAX_PAYLOAD:
            raise FrameError(f"payload over {MAX_PAYLOAD} bytes")
        regions.append(Region(sid, offset, length))
    if pos != len(view):
        raise FrameError(f"{len(view) - pos} trailing bytes in body")
    return regions


def decode_request(data: bytes | bytearray | memoryview) -> tuple[Header, list[Region]]:
    """Header and regions of a request at the start of `data` (what follows is payload)."""
    view = memoryview(data)
    if len(view) < HEADER_SIZE:
        raise FrameError("truncated header")
    header = decode_header(view[:HEADER_SIZE])
    if header.op is Op.REPLY:
        raise FrameError("a reply where a request was expected")
    end = HEADER_SIZE + header.body_len
    if len(view) < end:
        raise FrameError("truncated body")
    return header, decode_ops(header, view[HEADER_SIZE:end])


def payload_length(regions: Sequence[Region]) -> int:
    return sum(r.length for r in regions)


def encode_reply(
    request_id: int, count: int, reason: ErrorReason | None = None, msg: str = ""
) -> bytes:
    status = 0 if reason is None else REASONS.index(reason) + 1
    body = msg.encode()[:MAX_MESSAGE] if reason is not None else b""
    return encode_header(Header(Op.REPLY, status, request_id, count, len(body))) + body


def reply_reason(header: Header) -> ErrorReason | None:
    """None for success, else the reason a REPLY header carries."""
    if header.op is not Op.REPLY:
        raise FrameError(f"expected a reply, got {header.op.name}")
    return None if header.status == 0 else REASONS[header.status - 1]

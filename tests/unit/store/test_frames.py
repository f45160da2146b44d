"""Fuzzing the tcp wire format: decoding untrusted bytes raises only `FrameError`, and no
region a decoded frame names ever resolves outside a registered segment."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.store.segment import Segment
from mooncake.store.transfer import SegmentTable, TransferError, frames
from mooncake.store.types import Region

SEGMENT_SIZE = 64 << 10


@pytest.fixture(scope="module")
def table() -> Iterator[SegmentTable]:
    t = SegmentTable()
    t.add(Segment.create_dram("seg-0", "n", SEGMENT_SIZE))
    yield t
    for seg in t.segments():
        t.remove(seg.info.segment_id)
        seg.close()


regions = st.builds(
    Region,
    st.sampled_from(["seg-0", "seg-1", "x" * 255, "é"]),
    st.integers(0, frames.MAX_OFFSET),
    st.integers(0, 1 << 20),
)
requests = st.builds(
    lambda op, rid, rs: frames.encode_request(op, rid, rs),
    st.sampled_from([frames.Op.WRITE, frames.Op.READ]),
    st.integers(0, 2**64 - 1),
    st.lists(regions, min_size=1, max_size=8),
)


def _decode_and_resolve(data: bytes, table: SegmentTable) -> None:
    try:
        _, decoded = frames.decode_request(data)
    except frames.FrameError:
        return
    for region in decoded:
        try:
            view = table.resolve(region)
        except TransferError as exc:
            assert exc.reason in ("out_of_bounds", "unknown_segment")
            continue
        assert region.segment_id == "seg-0"
        assert 0 <= region.offset and region.offset + region.length <= SEGMENT_SIZE
        assert len(view) == region.length


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=400))
def test_arbitrary_bytes_raise_only_frame_errors(table: SegmentTable, data: bytes) -> None:
    _decode_and_resolve(data, table)


@settings(max_examples=400, deadline=None)
@given(requests, st.data())
def test_mutated_valid_frames(table: SegmentTable, frame: bytes, data: st.DataObject) -> None:
    raw = bytearray(frame)
    for _ in range(data.draw(st.integers(1, 6))):
        kind = data.draw(st.sampled_from(["flip", "truncate", "extend", "splice"]))
        if kind == "flip" and raw:
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] = data.draw(st.integers(0, 255))
        elif kind == "truncate" and raw:
            del raw[data.draw(st.integers(0, len(raw) - 1)) :]
        elif kind == "extend":
            raw += data.draw(st.binary(max_size=32))
        elif kind == "splice" and raw:
            i = data.draw(st.integers(0, len(raw)))
            raw[i:i] = data.draw(st.binary(min_size=1, max_size=16))
    _decode_and_resolve(bytes(raw), table)


@given(requests)
def test_valid_frames_round_trip(frame: bytes) -> None:
    header, decoded = frames.decode_request(frame)
    assert header.count == len(decoded)
    assert frames.encode_request(header.op, header.request_id, decoded) == frame


def test_header_validation() -> None:
    good = frames.encode_request(frames.Op.READ, 1, [Region("s", 0, 1)])
    with pytest.raises(frames.FrameError, match="magic"):
        frames.decode_request(b"XXXX" + good[4:])
    with pytest.raises(frames.FrameError, match="version"):
        frames.decode_request(good[:4] + b"\x09" + good[5:])
    with pytest.raises(frames.FrameError, match="unknown op"):
        frames.decode_request(good[:5] + b"\x63" + good[6:])
    with pytest.raises(frames.FrameError, match="truncated"):
        frames.decode_request(good[:-1])
    many = frames.Header(frames.Op.READ, 0, 1, frames.MAX_OPS + 1, 100)
    with pytest.raises(frames.FrameError, match="ops in one frame"):
        frames.decode_header(frames.encode_header(many))


def test_replies() -> None:
    ok = frames.decode_header(frames.encode_reply(5, 2)[: frames.HEADER_SIZE])
    assert frames.reply_reason(ok) is None and ok.request_id == 5
    raw = frames.encode_reply(6, 1, "out_of_bounds", "too far")
    err = frames.decode_header(raw[: frames.HEADER_SIZE])
    assert frames.reply_reason(err) == "out_of_bounds"
    assert raw[frames.HEADER_SIZE :] == b"too far"


def test_encoder_refuses_what_decoder_would() -> None:
    with pytest.raises(ValueError):
        frames.encode_request(frames.Op.WRITE, 1, [])
    with pytest.raises(ValueError):
        frames.encode_request(frames.Op.WRITE, 1, [Region("s", -1, 1)])
    with pytest.raises(ValueError):
        frames.encode_request(frames.Op.WRITE, 1, [Region("s" * 256, 0, 1)])

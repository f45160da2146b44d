"""The `Transport` contract: every transport must pass every case here (see conftest.py)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from transport_rig import BIG, SMALL, Rig

from mooncake.store.transfer import TransferError
from mooncake.store.types import Region

MiB = 1 << 20


def _rand(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


async def test_round_trip_random_offsets(rig: Rig) -> None:
    rng = random.Random(7)
    size = rig.segments[BIG].info.size
    for i in range(24):
        length = rng.choice([1, 7, 4096, 65536, rng.randrange(1, 3 * MiB)])
        offset = rng.randrange(0, size - length + 1)
        data = _rand(length, i)
        region = Region(BIG, offset, length)
        await rig.client.write(rig.ep(), region, data)
        out = bytearray(length)
        await rig.client.read_into(rig.ep(), region, out)
        assert out == data, f"round trip {i} at {offset}+{length}"


async def test_write_lands_in_segment_memory(rig: Rig) -> None:
    data = _rand(10_000, 1)
    await rig.client.write(rig.ep(SMALL), Region(SMALL, 123, len(data)), data)
    assert bytes(rig.segments[SMALL].buf[123 : 123 + len(data)]) == data


SOURCES: dict[str, Callable[[bytes], Any]] = {
    "bytes": lambda b: b,
    "bytearray": bytearray,
    "memoryview": lambda b: memoryview(bytearray(b)),
    "readonly-memoryview": memoryview,
    "numpy": lambda b: np.frombuffer(b, dtype=np.float32).copy(),
    "numpy-2d": lambda b: np.frombuffer(b, dtype=np.uint8).reshape(64, -1).copy(),
    "torch": lambda b: torch.frombuffer(bytearray(b), dtype=torch.float32),
    "torch-bf16-view": lambda b: torch.frombuffer(bytearray(b), dtype=torch.int16).view(-1, 8),
}


@pytest.mark.parametrize("kind", list(SOURCES))
async def test_write_from_every_buffer_type(rig: Rig, kind: str) -> None:
    data = _rand(64 * 1024, 2)
    await rig.client.write(rig.ep(), Region(BIG, 4096, len(data)), SOURCES[kind](data))
    out = bytearray(len(data))
    await rig.client.read_into(rig.ep(), Region(BIG, 4096, len(data)), out)
    assert out == data


SINKS: dict[str, Callable[[int], Any]] = {
    "bytearray": bytearray,
    "memoryview": lambda n: memoryview(bytearray(n)),
    "numpy": lambda n: np.zeros(n // 4, dtype=np.float32),
    "torch": lambda n: torch.zeros(n // 2, dtype=torch.bfloat16).view(torch.int16),
    "torch-2d": lambda n: torch.zeros((16, n // 64), dtype=torch.float32),
}


def _as_bytes(obj: Any) -> bytes:
    if isinstance(obj, torch.Tensor):
        return obj.numpy().tobytes()
    if isinstance(obj, np.ndarray):
        return obj.tobytes()
    return bytes(obj)


@pytest.mark.parametrize("kind", list(SINKS))
async def test_read_into_fills_caller_buffer_in_place(rig: Rig, kind: str) -> None:
    data = _rand(64 * 1024, 3)
    region = Region(BIG, 3 * MiB + 5, len(data))
    await rig.client.write(rig.ep(), region, data)
    out = SINKS[kind](len(data))
    before = id(out)
    await rig.client.read_into(rig.ep(), region, out)
    assert id(out) == before
    assert _as_bytes(out) == data


async def test_read_into_rejects_read_only_buffers(rig: Rig) -> None:
    with pytest.raises(TypeError):
        await rig.client.read_into(rig.ep(), Region(BIG, 0, 4), b"abcd")


async def test_batch_forms(rig: Rig) -> None:
    ops = []  # distinct regions in both segments, so no op overwrites another
    for i in range(200):
        if i % 2:
            ops.append((Region(BIG, 8 * MiB + i * 4096, 4096), _rand(4096, 100 + i)))
        else:
            ops.append((Region(SMALL, i // 2 * 2048, 2048), _rand(2048, 100 + i)))
    # A batch goes to one endpoint: group by it (tcp and rdma serve a node's segments at one
    # endpoint, shm has one per segment).
    groups: dict[str, list[int]] = {}
    for i, (region, _) in enumerate(ops):
        groups.setdefault(rig.ep(region.segment_id), []).append(i)
    for endpoint, idx in groups.items():
        await rig.client.write_many(endpoint, [ops[i] for i in idx])
    outs = [bytearray(r.length) for r, _ in ops]
    for endpoint, idx in groups.items():
        await rig.client.read_many(endpoint, [(ops[i][0], outs[i]) for i in idx])
    for (_, data), out in zip(ops, outs, strict=True):
        assert out == data
    # mixed sizes in one batch, one of them larger than any slice
    big = _rand(9 * MiB, 5)
    mixed = [(Region(BIG, 0, 100), b"x" * 100), (Region(BIG, MiB, len(big)), big)]
    await rig.client.write_many(rig.ep(), mixed)
    out_small, out_big = bytearray(100), bytearray(len(big))
    await rig.client.read_many(
        rig.ep(), [(Region(BIG, 0, 100), out_small), (Region(BIG, MiB, len(big)), out_big)]
    )
    assert out_small == b"x" * 100 and out_big == big
    await rig.client.write_many(rig.ep(), [])
    await rig.client.read_many(rig.ep(), [])


BAD_REGIONS = [
    (Region(SMALL, 256 << 10, 1), "out_of_bounds"),
    (Region(SMALL, (256 << 10) - 10, 11), "out_of_bounds"),
    (Region(SMALL, -1, 10), "out_of_bounds"),
    (Region(SMALL, 1 << 62, 1), "out_of_bounds"),
    (Region("no-such-segment", 0, 10), "unknown_segment"),
]


@pytest.mark.parametrize(("region", "reason"), BAD_REGIONS)
async def test_bad_regions_fail_and_server_keeps_serving(
    rig: Rig, region: Region, reason: str
) -> None:
    endpoint = rig.ep(SMALL)
    data = bytes(region.length)
    with pytest.raises(TransferError) as write_err:
        await rig.client.write(endpoint, region, data)
    assert write_err.value.reason == reason
    with pytest.raises(TransferError) as read_err:
        await rig.client.read_into(endpoint, region, bytearray(region.length))
    assert read_err.value.reason == reason
    with pytest.raises(TransferError) as batch_err:
        await rig.client.read_many(
            endpoint, [(Region(SMALL, 0, 8), bytearray(8)), (region, bytearray(region.length))]
        )
    assert batch_err.value.reason == reason
    # still serving, on the same client
    good = Region(SMALL, 0, 4096)
    await rig.client.write(endpoint, good, b"k" * 4096)
    out = bytearray(4096)
    await rig.client.read_into(endpoint, good, out)
    assert out == b"k" * 4096
    assert bytes(rig.segments[SMALL].buf[(256 << 10) - 16 :]) == bytes(16)  # nothing spilled


async def test_length_mismatch_is_bad_request(rig: Rig) -> None:
    with pytest.raises(TransferError) as err:
        await rig.client.write(rig.ep(), Region(BIG, 0, 10), b"123")
    assert err.value.reason == "bad_request"
    with pytest.raises(TransferError) as err:
        await rig.client.read_into(rig.ep(), Region(BIG, 0, 10), bytearray(11))
    assert err.value.reason == "bad_request"


async def test_concurrent_writers_to_distinct_regions(rig: Rig) -> None:
    chunks = [_rand(256 * 1024 + i, 200 + i) for i in range(16)]
    offsets = [i * (MiB + 4096) for i in range(16)]

    async def put(i: int) -> None:
        await rig.client.write(rig.ep(), Region(BIG, offsets[i], len(chunks[i])), chunks[i])

    await asyncio.gather(*(put(i) for i in range(16)))
    outs = [bytearray(len(c)) for c in chunks]
    await asyncio.gather(
        *(
            rig.client.read_into(rig.ep(), Region(BIG, offsets[i], len(chunks[i])), outs[i])
            for i in range(16)
        )
    )
    assert outs == chunks


async def test_large_transfer_integrity(rig: Rig) -> None:
    data = np.random.default_rng(5).integers(0, 256, 16 * MiB, dtype=np.uint8)
    region = Region(BIG, 3 * MiB + 1, data.nbytes)
    await rig.client.write(rig.ep(), region, data)
    out = np.empty_like(data)
    await rig.client.read_into(rig.ep(), region, out)
    assert np.array_equal(out, data)
    seg = np.frombuffer(rig.segments[BIG].buf, dtype=np.uint8)
    assert np.array_equal(seg[region.offset : region.offset + region.length], data)
    del seg


async def test_zero_length_region(rig: Rig) -> None:
    await rig.client.write(rig.ep(), Region(BIG, 10, 0), b"")
    await rig.client.read_into(rig.ep(), Region(BIG, 10, 0), bytearray())


async def test_reaches_own_endpoints_only(rig: Rig) -> None:
    assert rig.client.reaches(rig.ep())
    assert not rig.client.reaches("")

"""Everything of the rdma transport above the verbs calls, over the verbs fake: handshake
authentication, segment registration following the table, staging waves, failure handling,
and the NATS rendezvous against a real NATS."""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import nats
import pytest
import pytest_asyncio

from mooncake.store.segment import Segment
from mooncake.store.transfer import SegmentTable, TransferError, available, rdma
from mooncake.store.transfer.rdma import LocalRendezvous, NatsRendezvous, RdmaServer, RdmaTransport
from mooncake.store.transfer.verbs import ACCESS_ERROR, FLUSHED, FakeFabric, QpInfo
from mooncake.store.types import Region

SECRET = b"rdma-secret"


@dataclass
class Pair:
    fabric: FakeFabric
    table: SegmentTable
    server: RdmaServer
    client: RdmaTransport
    seg: Segment


@pytest_asyncio.fixture
async def pair() -> AsyncIterator[Pair]:
    fabric, rendezvous = FakeFabric(), LocalRendezvous()
    seg = Segment.create_dram("a", "n1", 1 << 20)
    table = SegmentTable()
    table.add(seg)
    server = RdmaServer(secret=SECRET, node_id="n1", rendezvous=rendezvous, verbs=fabric.context)
    await server.start(table)
    client = RdmaTransport(
        secret=SECRET,
        rendezvous=rendezvous,
        verbs=fabric.context,
        staging_bytes=64 << 10,
        qp_depth=8,
    )
    try:
        yield Pair(fabric, table, server, client, seg)
    finally:
        await client.close()
        await server.stop()
        for s in table.segments():
            table.remove(s.info.segment_id)
            s.close()
        seg.close()


def test_availability_has_a_reason() -> None:
    ok, why = available("rdma")
    assert why
    if not ok:
        assert "pyverbs" in why or "device" in why


async def test_real_device_missing_is_unavailable() -> None:
    ok, why = available("rdma")
    if ok:
        pytest.skip("this host has an RDMA device")
    server = RdmaServer(secret=SECRET, rendezvous=LocalRendezvous())
    with pytest.raises(TransferError) as err:
        await server.start(SegmentTable())
    assert err.value.reason == "unavailable" and why in str(err.value)
    client = RdmaTransport(secret=SECRET, rendezvous=LocalRendezvous())
    assert not client.reaches("n1")


def test_handshake_messages_are_authenticated() -> None:
    info = QpInfo(1, "fe80::1", 17, 99)
    payload, nonce = rdma.connect_request(SECRET, info)
    assert rdma.open_request(SECRET, payload) == (nonce, info)
    with pytest.raises(TransferError) as err:
        rdma.open_request(b"other", payload)
    assert err.value.reason == "auth"
    tampered = payload.replace(b'"qpn":17', b'"qpn":18')
    with pytest.raises(TransferError, match="auth"):
        rdma.open_request(SECRET, tampered)
    reply = rdma.connect_reply(SECRET, nonce, info, {"a": (4096, 100, 7)})
    assert rdma.open_reply(SECRET, nonce, reply) == (info, {"a": (4096, 100, 7)})
    with pytest.raises(TransferError, match="another request"):
        rdma.open_reply(SECRET, "0" * 32, reply)
    with pytest.raises(TransferError, match="auth"):
        rdma.open_reply(b"other", nonce, reply)
    for junk in (b"", b"[]", b"{", b'{"nonce": 1}'):
        with pytest.raises(TransferError):
            rdma.open_request(SECRET, junk)


async def test_wrong_secret_is_refused_and_logged(
    pair: Pair, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="mooncake.store.transfer.rdma")
    rendezvous = pair.server._rendezvous
    intruder = RdmaTransport(secret=b"wrong", rendezvous=rendezvous, verbs=pair.fabric.context)
    with pytest.raises(TransferError) as err:
        await intruder.write("n1", Region("a", 0, 4), b"evil")
    assert err.value.reason == "auth"
    assert bytes(pair.seg.buf[:4]) == bytes(4)
    assert any("refused connect" in r.getMessage() for r in caplog.records)
    await intruder.close()


async def test_transfers_larger_than_staging_and_deeper_than_the_queue(pair: Pair) -> None:
    data = os.urandom(300_000)  # > 64 KiB staging: several waves
    await pair.client.write("n1", Region("a", 1000, len(data)), data)
    assert bytes(pair.seg.buf[1000 : 1000 + len(data)]) == data
    ops = [(Region("a", 512 * i, 512), os.urandom(512)) for i in range(50)]  # > depth 8
    await pair.client.write_many("n1", ops)
    outs = [bytearray(512) for _ in ops]
    await pair.client.read_many("n1", [(r, o) for (r, _), o in zip(ops, outs, strict=True)])
    assert outs == [d for _, d in ops]


async def test_segment_added_after_connect_is_found(pair: Pair) -> None:
    await pair.client.write("n1", Region("a", 0, 3), b"abc")  # connected, knows only "a"
    late = Segment.create_dram("b", "n1", 4096)
    pair.table.add(late)
    await pair.client.write("n1", Region("b", 10, 3), b"xyz")
    assert bytes(late.buf[10:13]) == b"xyz"


async def test_removed_segment_is_deregistered(pair: Pair) -> None:
    extra = Segment.create_dram("c", "n1", 4096)
    pair.table.add(extra)
    await pair.client.write("n1", Region("c", 0, 3), b"abc")
    pair.table.remove("c")  # the server deregisters it: its rkey is dead from now on
    with pytest.raises(TransferError) as err:
        await pair.client.write("n1", Region("c", 0, 3), b"zzz")
    assert err.value.reason == "connection"  # the work request failed on the stale rkey
    assert bytes(extra.buf[:3]) == b"abc"
    with pytest.raises(TransferError) as err:
        await pair.client.write("n1", Region("c", 0, 3), b"zzz")
    assert err.value.reason == "unknown_segment"  # after reconnecting the node no longer has it
    await pair.client.write("n1", Region("a", 0, 3), b"ok!")  # and the rest still works
    extra.close()


def test_fake_verbs_check_keys_bounds_and_state() -> None:
    fabric = FakeFabric()
    a, b = fabric.context("a"), fabric.context("b")
    abuf, bbuf = memoryview(bytearray(4096)), memoryview(bytearray(4096))
    amr, bmr = a.register(abuf), b.register(bbuf)
    qa, qb = a.create_qp(4), b.create_qp(4)
    with pytest.raises(RuntimeError):
        qa.post_write(0, amr, amr.addr, 1, bmr.addr, bmr.rkey)  # not connected yet
    qa.connect(qb.info())
    qb.connect(qa.info())
    abuf[:5] = b"hello"
    qa.post_write(1, amr, amr.addr, 5, bmr.addr + 100, bmr.rkey)
    assert qa.poll(4)[0].ok and bytes(bbuf[100:105]) == b"hello"
    qa.post_read(2, amr, amr.addr + 10, 5, bmr.addr + 100, bmr.rkey)
    assert qa.poll(4)[0].ok and bytes(abuf[10:15]) == b"hello"
    qa.post_write(3, amr, amr.addr, 8, bmr.addr + 4090, bmr.rkey)  # past the remote MR
    first = qa.poll(4)[0]
    assert not first.ok and first.status == ACCESS_ERROR
    qa.post_write(4, amr, amr.addr, 1, bmr.addr, bmr.rkey)  # QP now in error: flushed
    flushed = qa.poll(4)[0]
    assert not flushed.ok and flushed.status == FLUSHED
    assert bytes(bbuf[4090:]) == bytes(6)
    qc = a.create_qp(4)
    qc.connect(b.create_qp(4).info())
    qc.post_write(5, amr, amr.addr, 1, bmr.addr, bmr.rkey + 1)  # wrong rkey
    assert not qc.poll(1)[0].ok
    b.deregister(bmr)
    qd = a.create_qp(4)
    qd.connect(b.create_qp(4).info())
    qd.post_write(6, amr, amr.addr, 1, bmr.addr, bmr.rkey)  # deregistered
    assert not qd.poll(1)[0].ok
    a.close()
    b.close()


async def test_nats_rendezvous(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    prefix = f"test{uuid.uuid4().hex[:8]}"
    fabric = FakeFabric()
    seg = Segment.create_dram("a", "n9", 1 << 16)
    table = SegmentTable()
    table.add(seg)
    server = RdmaServer(
        secret=SECRET, node_id="n9", nc=nc, subject_prefix=prefix, verbs=fabric.context
    )
    client = RdmaTransport(secret=SECRET, nc=nc, subject_prefix=prefix, verbs=fabric.context)
    try:
        await server.start(table)
        assert NatsRendezvous(nc, prefix).subject("n9") == f"{prefix}.store.rdma.n9.connect"
        await client.write(server.endpoint("a"), Region("a", 5, 4), b"nats")
        out = bytearray(4)
        await client.read_into("n9", Region("a", 5, 4), out)
        assert out == b"nats"
        with pytest.raises(TransferError) as err:
            await client.read_into("nobody", Region("a", 0, 1), bytearray(1))
        assert err.value.reason == "unreachable"
    finally:
        await client.close()
        await server.stop()
        table.remove("a")
        seg.close()
        await nc.close()

"""Activations between pipeline stages over the real transports (serving.activations): a
sender faster than its receiver fills the ring and waits, never overwrites; every chunk
arrives whole, in order, in its dtype."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
import torch

from mooncake.serving.activations import Inbox, Outbox, inbox_bytes, slot_bytes
from mooncake.store.segment import Segment
from mooncake.store.transfer import SegmentTable, Transport, make_client, make_server

SECRET = b"activations-test-secret"
SLOTS, ROWS, COLS = 2, 64, 48


@pytest_asyncio.fixture(params=["shm", "tcp"])
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Inbox, Outbox]]:
    segment_id = f"act-{uuid.uuid4().hex[:8]}"
    segment = Segment.create_dram(segment_id, "stage-1", inbox_bytes(SLOTS, ROWS, COLS))
    table = SegmentTable()
    table.add(segment)
    server = make_server(request.param, secret=SECRET)
    await server.start(table)
    client: Transport = make_client(request.param, secret=SECRET)
    size = slot_bytes(ROWS, COLS)
    try:
        yield (
            Inbox(segment, SLOTS, size),
            Outbox(client, server.endpoint(segment_id), segment_id, SLOTS, size),
        )
    finally:
        await client.close()
        await server.stop()
        table.remove(segment_id)
        segment.close()


async def test_chunks_arrive_whole_and_in_order_past_a_slow_receiver(
    pair: tuple[Inbox, Outbox],
) -> None:
    inbox, outbox = pair
    gen = torch.Generator().manual_seed(1)
    chunks = [torch.randn(1, ROWS - 7 * i, COLS, generator=gen) for i in range(6)]
    chunks.append(torch.randn(ROWS, COLS, generator=gen).to(torch.bfloat16))

    async def send() -> list[int]:
        ahead = []
        for c in chunks:
            await outbox.send(c)
            ahead.append(outbox.sent - inbox.received)  # never more than the ring holds
        return ahead

    sending = asyncio.create_task(send())
    got = []
    for _ in chunks:
        await asyncio.sleep(0.02)  # a receiver slower than its sender
        got.append(await inbox.receive(timeout_s=5))
    ahead = await sending
    assert max(ahead) == SLOTS  # the sender filled the ring, then waited
    for want, have in zip(chunks, got, strict=True):
        assert have.dtype == want.dtype
        assert torch.equal(have, want.reshape(-1, COLS))


async def test_a_chunk_bigger_than_a_slot_is_refused(pair: tuple[Inbox, Outbox]) -> None:
    _, outbox = pair
    with pytest.raises(ValueError, match="does not fit"):
        await outbox.send(torch.zeros(ROWS + 1, COLS))
    assert outbox.sent == 0


async def test_nothing_sent_times_out(pair: tuple[Inbox, Outbox]) -> None:
    inbox, _ = pair
    with pytest.raises(TimeoutError):
        await inbox.receive(timeout_s=0.05)

"""The `rig` fixture: one per transport (see transport_rig.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from transport_rig import BIG, SECRET, SMALL, TRANSPORTS, Rig, options

from mooncake.store.segment import Segment
from mooncake.store.transfer import SegmentTable, make_client, make_server


@pytest_asyncio.fixture(params=TRANSPORTS)
async def rig(request: pytest.FixtureRequest) -> AsyncIterator[Rig]:
    kind, server_opts, client_opts = options(request.param)
    segments = {
        BIG: Segment.create_dram(BIG, "node-a", 20 << 20),
        SMALL: Segment.create_dram(SMALL, "node-a", 256 << 10),
    }
    table = SegmentTable()
    for seg in segments.values():
        table.add(seg)
    server = make_server(kind, secret=SECRET, **server_opts)
    await server.start(table)
    client = make_client(kind, secret=SECRET, **client_opts)
    try:
        yield Rig(request.param, table, server, client, segments)
    finally:
        await client.close()
        await server.stop()
        for seg in segments.values():
            table.remove(seg.info.segment_id)
            seg.close()

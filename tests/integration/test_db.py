"""The Postgres record: migrations vs models, append-only log, stream-order projections,
rebuild identical to live, and a verification that can fail."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from mooncake import events as ev
from mooncake.config import Settings
from mooncake.db.engine import check
from mooncake.db.rebuild import read_projections, rebuild, verify
from mooncake.db.record import Incoming, record_events

pytestmark = pytest.mark.integration
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def test_models_and_migrations_do_not_drift(settings: Settings) -> None:
    assert settings.database_url
    check(settings.database_url)  # raises alembic's CommandError on drift


def _lifecycle(rid: str, seq0: int) -> list[Incoming]:
    es: list[ev.Event] = [
        ev.RequestSubmitted(request_id=rid, token_ids=[1, 2, 3], occurred_at=T0),
        ev.RequestAdmitted(request_id=rid, policy="none", occurred_at=T0 + timedelta(seconds=1)),
        ev.PrefillStarted(request_id=rid, instance="p0", occurred_at=T0 + timedelta(seconds=2)),
        ev.RequestPrefilled(
            request_id=rid, instance="p0", prompt_tokens=3, cached_tokens=2,
            occurred_at=T0 + timedelta(seconds=3),
        ),
    ]  # fmt: skip
    return [Incoming(e, "MC_REQ", seq0 + i, e.SUBJECT) for i, e in enumerate(es)]


async def test_events_are_append_only(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await record_events(conn, _lifecycle("a", 1)[:1])
    with pytest.raises(DBAPIError, match="append-only"):
        async with engine.begin() as conn:
            await conn.execute(text("UPDATE events SET type = 'x'"))
    with pytest.raises(DBAPIError, match="append-only"):
        async with engine.begin() as conn:
            await conn.execute(text("DELETE FROM events"))


async def test_out_of_order_arrival_folds_in_stream_order_and_rebuild_is_identical(
    engine: AsyncEngine,
) -> None:
    a = _lifecycle("a", 1)
    b = _lifecycle("b", 10)
    kv = ev.KvObjectStored(key="k1", size_bytes=7, replicas=[ev.Replica(node="n", segment="s")])
    inst = ev.InstanceRegistered(instance_id="p0", role="prefill")
    meta = [Incoming(kv, "MC_META", 1, kv.SUBJECT), Incoming(inst, "MC_META", 2, inst.SUBJECT)]
    # a arrives scrambled across batches (a redelivery after a crash); b and a duplicate too.
    batches = [[a[1], b[0], meta[0]], [a[0], b[1], b[2]], [a[3], a[2], b[3], a[0]], [meta[1]]]
    for batch in batches:
        async with engine.begin() as conn:
            await record_events(conn, batch)
    async with engine.connect() as conn:
        live = await read_projections(conn)
    assert live["requests"]["a"]["status"] == "prefilled"
    assert live["requests"]["a"]["illegal_events"] == 0
    assert live["requests"]["a"]["cached_tokens"] == 2
    assert live["requests"]["b"]["status"] == "prefilled"
    assert set(live["kv_objects"]) == {"k1"} and set(live["instances"]) == {"p0"}
    assert await verify(engine) == []
    counts = await rebuild(engine)
    assert counts == {"requests": 2, "kv_objects": 1, "instances": 1}
    async with engine.connect() as conn:
        assert await read_projections(conn) == live


async def test_verify_detects_a_projection_that_drifted(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await record_events(conn, _lifecycle("a", 1))
    async with engine.begin() as conn:
        await conn.execute(text("UPDATE requests SET output_tokens = 99"))
    diffs = await verify(engine)
    assert diffs and "output_tokens" in diffs[0]
    await rebuild(engine)
    assert await verify(engine) == []


async def test_an_event_id_reused_for_another_request_is_recorded_once_per_request(
    engine: AsyncEngine,
) -> None:
    """A client that reuses an event id for two requests: both submissions are facts (each
    request gets its row); the same message delivered again is still a duplicate."""

    def submitted(rid: str, seq: int) -> Incoming:
        e = ev.RequestSubmitted(event_id="NaN", request_id=rid, token_ids=[1], occurred_at=T0)
        return Incoming(e, "MC_REQ", seq, e.SUBJECT)

    a, b, c = submitted("a", 1), submitted("b", 2), submitted("c", 3)
    async with engine.begin() as conn:
        first = await record_events(conn, [a, b])  # the reuse inside one batch
    async with engine.begin() as conn:
        second = await record_events(conn, [c, b, a])  # across batches, and redeliveries
    assert (first.inserted, first.duplicates) == (2, 0)
    assert (second.inserted, second.duplicates) == (1, 2)
    async with engine.connect() as conn:
        rows = (
            await conn.execute(text("SELECT request_id, event_id FROM events ORDER BY stream_seq"))
        ).all()
        live = await read_projections(conn)
    assert [r for r, _ in rows] == ["a", "b", "c"]
    assert rows[0][1] == "NaN" and len({e for _, e in rows}) == 3
    assert {k: v["status"] for k, v in live["requests"].items()} == dict.fromkeys(
        "abc", "submitted"
    )
    assert await verify(engine) == []

"""10,000 submitted events, the recorder killed -9 and restarted in the middle, publishes
retried with the same event id (and copies beyond the dedupe window): exactly 10,000 rows
in `events` and a `requests` projection equal to its rebuild."""

from __future__ import annotations

from pathlib import Path

import nats
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from mooncake import events as ev
from mooncake.bus.connection import ensure_streams
from mooncake.bus.publish import MSG_ID, Publisher
from mooncake.config import Settings
from mooncake.db.rebuild import verify

from helpers import Worker, scalar, wait_for

pytestmark = pytest.mark.integration
N = 10_000


async def _settled(js, ns: ev.Namespace) -> bool:  # type: ignore[no-untyped-def]
    info = await js.consumer_info(ns.stream("MC_REQ"), "recorder")
    return info.num_pending == 0 and info.num_ack_pending == 0


async def test_ten_thousand_events_exactly_once_across_a_recorder_crash(
    settings: Settings, engine: AsyncEngine, tmp_path: Path
) -> None:
    ns = ev.Namespace(settings.namespace)
    nc = await nats.connect(settings.nats_url)
    js = nc.jetstream()
    await ensure_streams(js, settings)
    publisher = Publisher(nc, js, ns)
    batch = [ev.RequestSubmitted(request_id=f"r{i}", token_ids=[1 + i % 50]) for i in range(N)]
    recorder = Worker("recorder", settings, tmp_path).start()
    try:
        for start in range(0, N // 2, 500):
            await publisher.publish_many(batch[start : start + 500])

        async def some_recorded() -> bool:
            return int(await scalar(engine, "SELECT count(*) FROM events")) >= 500  # type: ignore[arg-type]

        await wait_for(some_recorded, 60, "the recorder to start recording")
        recorder.kill()
        recorded_at_kill = int(await scalar(engine, "SELECT count(*) FROM events"))  # type: ignore[arg-type]

        for start in range(N // 2, N, 500):
            await publisher.publish_many(batch[start : start + 500])
        # Retried publishes with the same event id: the broker's dedupe window drops them.
        for e in batch[:300]:
            await publisher.publish(e)
        # Copies that slip past the dedupe window (different message id, same event):
        # the recorder's unique index must drop them.
        for e in batch[1000:1200]:
            await js.publish(ns.of(e), e.to_json(), headers={MSG_ID: "late-" + e.event_id})
        stream = await js.stream_info(ns.stream("MC_REQ"))
        assert stream.state.messages == N + 200

        recorder = Worker("recorder", settings, tmp_path, name="recorder-1").start()
        await wait_for(lambda: _settled(js, ns), 120, "the restarted recorder to catch up")
    finally:
        recorder.stop()
        await nc.close()

    assert 500 <= recorded_at_kill < N, "the kill must land in the middle"
    # Exactly once: N rows of MC_REQ, and they are the N events published (the 300 retries
    # and the 200 late copies on the stream left no row of their own).
    async with engine.connect() as conn:
        rows = await conn.execute(text("SELECT event_id FROM events WHERE stream = :s"),
                                  {"s": ns.stream("MC_REQ")})  # fmt: skip
        recorded = [r[0] for r in rows]
    assert len(recorded) == N
    assert set(recorded) == {e.event_id for e in batch}
    assert await scalar(engine, "SELECT count(*) FROM requests") == N
    assert await scalar(engine, "SELECT count(*) FROM requests WHERE status <> 'submitted'") == 0
    assert await scalar(engine, "SELECT sum(illegal_events) FROM requests") == 0
    assert await verify(engine) == []

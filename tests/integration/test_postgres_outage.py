"""Postgres stopped while events flow: the recorder holds its batch, loses nothing, and
catches up when the database is back."""

from __future__ import annotations

import asyncio
from pathlib import Path

import nats
import pytest

from mooncake import events as ev
from mooncake.bus.connection import ensure_streams
from mooncake.bus.publish import Publisher
from mooncake.config import Settings
from mooncake.db.engine import async_engine
from mooncake.db.rebuild import verify
from mooncake.services import EmbeddedPostgres

from helpers import Worker, scalar, wait_for

pytestmark = pytest.mark.integration


async def test_recorder_survives_a_database_outage(
    own_postgres: EmbeddedPostgres, settings: Settings, tmp_path: Path
) -> None:
    settings = Settings(**{**settings.model_dump(), "database_url": own_postgres.url})
    ns = ev.Namespace(settings.namespace)
    engine = async_engine(own_postgres.url)
    nc = await nats.connect(settings.nats_url)
    js = nc.jetstream()
    await ensure_streams(js, settings)
    pub = Publisher(nc, js, ns)
    recorder = Worker("recorder", settings, tmp_path).start()
    try:
        await pub.publish_many(
            [ev.RequestSubmitted(request_id=f"a{i}", prompt="x") for i in range(200)]
        )

        async def count_is(n: int) -> bool:
            return await scalar(engine, "SELECT count(*) FROM requests") == n

        await wait_for(lambda: count_is(200), 60, "the first 200 recorded")
        own_postgres.stop()
        await engine.dispose()
        await pub.publish_many(
            [ev.RequestSubmitted(request_id=f"b{i}", prompt="x") for i in range(300)]
        )
        await asyncio.sleep(3)  # the recorder is now retrying against a dead database
        assert recorder.proc is not None and recorder.proc.poll() is None
        own_postgres.start()
        await wait_for(lambda: count_is(500), 60, "the held events recorded after the outage")
    finally:
        code = recorder.stop()
        await nc.close()
    assert code == 0
    assert await scalar(engine, "SELECT count(*) FROM events WHERE type='request.submitted'") == 500
    assert await verify(engine) == []
    await engine.dispose()

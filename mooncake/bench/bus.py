"""`mooncake bench bus`: what the bus layer costs, measured against a baseline in the same run.

Everything runs on a private, throw-away NATS server and Postgres in a temporary directory
(never the user's), which are stopped and removed at the end.

- Recorder throughput: `events` RequestSubmitted facts are published (pipelined, in chunks)
  while a real recorder worker process consumes them; the clock runs from the first publish
  until the `events` table holds all of them (the recorder commits, then acks).
- Relay latency over 3 hops: see `mooncake.bench.relays`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import nats

from mooncake import events as ev
from mooncake.bench.relays import Log, run_relays, submitted
from mooncake.bus.connection import connect, ensure_streams
from mooncake.bus.publish import Publisher
from mooncake.config import Settings
from mooncake.db.engine import upgrade
from mooncake.services import EmbeddedNats, EmbeddedPostgres, ManagedProcess
from mooncake.telemetry import setup_tracing

RECORDER_NAMESPACE = "bench"
PUBLISH_CHUNK = 500


def _libpq_url(url: str) -> str:
    return "postgresql://" + url.split("://", 1)[1]


# --- recorder throughput ------------------------------------------------------------------------


def _start_recorder(settings: Settings, tmp: Path) -> ManagedProcess:
    assert settings.database_url
    env = dict(os.environ)
    env.update(
        {
            "MOONCAKE_NATS_URL": settings.nats_url,
            "MOONCAKE_DATABASE_URL": settings.database_url,
            "MOONCAKE_NAMESPACE": settings.namespace,
            "MOONCAKE_DATA_DIR": str(tmp),
            "MOONCAKE_RECORDER_BATCH": str(settings.recorder_batch),
            "MOONCAKE_METRICS_PORT": "-1",
            "MOONCAKE_OTLP_ENDPOINT": "",
        }
    )
    argv = [sys.executable, "-m", "mooncake.cli", "worker", "recorder", "--instance", "bench"]
    proc = ManagedProcess("recorder", argv, tmp / "logs" / "recorder.log", 0, env=env)
    proc.spawn()
    return proc


def _log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


async def _poll(
    count: Callable[[], Awaitable[int]],
    target: int,
    recorder: ManagedProcess,
    limit_s: float,
    interval_s: float,
) -> int:
    """Poll `count` until it reaches `target`; fail if the recorder dies or time runs out."""
    deadline = time.monotonic() + limit_s
    while (seen := await count()) < target:
        if not recorder.running:
            raise RuntimeError("the recorder exited:\n" + _log_tail(recorder.log_path))
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {seen} of {target} recorded within {limit_s:.0f}s")
        await asyncio.sleep(interval_s)
    return seen


async def run_recorder(settings: Settings, events: int, tmp: Path, log: Log) -> dict[str, Any]:
    import psycopg

    assert settings.database_url
    ns = ev.Namespace(settings.namespace)
    nc = await connect(settings, "bench-publisher")
    db = await psycopg.AsyncConnection.connect(_libpq_url(settings.database_url), autocommit=True)
    recorder = _start_recorder(settings, tmp)

    async def count(type_: str) -> int:
        row = await (
            await db.execute("SELECT count(*) FROM events WHERE type = %s", (type_,))
        ).fetchone()
        return int(row[0]) if row else 0

    publishing: asyncio.Task[float] | None = None
    try:
        js = nc.jetstream()
        await ensure_streams(js, settings)
        publisher = Publisher(nc, js, ns)
        # The recorder records its own registration once its consumers run: then it is ready.
        await _poll(lambda: count("instance.registered"), 1, recorder, 60.0, 0.1)
        batch = [submitted(f"bench-{i:07d}") for i in range(events)]
        log.print(
            f"recorder: publishing {events} events in chunks of {PUBLISH_CHUNK} "
            f"(recorder_batch={settings.recorder_batch})"
        )

        async def publish_all() -> float:
            for start in range(0, len(batch), PUBLISH_CHUNK):
                await publisher.publish_many(batch[start : start + PUBLISH_CHUNK])
            return time.perf_counter()

        started = time.perf_counter()
        publishing = asyncio.create_task(publish_all())
        limit_s = max(120.0, events / 200)
        seen = await _poll(lambda: count("request.submitted"), events, recorder, limit_s, 0.02)
        recorded_at = time.perf_counter()
        published_at = await publishing
        projected = (await (await db.execute("SELECT count(*) FROM requests")).fetchone() or [0])[0]
        if seen != events or projected != events:
            raise RuntimeError(f"recorded {seen} events and {projected} requests, not {events}")
    finally:
        if publishing is not None and not publishing.done():
            publishing.cancel()
        await asyncio.to_thread(recorder.stop, 15)
        await db.close()
        with contextlib.suppress(Exception):
            await nc.close()
    elapsed = recorded_at - started
    return {
        "recorded_events_per_s": round(events / elapsed, 1),
        "recorded_seconds": round(elapsed, 3),
        "published_events_per_s": round(events / (published_at - started), 1),
        "recorder_batch": settings.recorder_batch,
    }


# --- the whole run --------------------------------------------------------------------------------


async def _server_version(url: str) -> str:
    nc = await nats.connect(url)
    try:
        v = nc.connected_server_version
        return f"{v.major}.{v.minor}.{v.patch}"
    finally:
        await nc.close()


async def run_bus_bench(
    settings: Settings, *, events: int, relays: int, log: Log
) -> dict[str, Any]:
    if events < 1 or relays < 1:
        raise ValueError("events and relays must be at least 1")
    tmp = Path(tempfile.mkdtemp(prefix="mooncake-bench-"))
    broker: EmbeddedNats | None = None
    database: EmbeddedPostgres | None = None
    quiet = logging.getLogger("mooncake.bus.connection")  # our own closes are not news
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        log.print(f"bench: private NATS and Postgres under {tmp}")
        broker = await asyncio.to_thread(lambda: EmbeddedNats.create(tmp).start())
        bench = settings.model_copy(
            update={
                "nats_url": broker.url,
                "namespace": RECORDER_NAMESPACE,
                "data_dir": tmp,
                "otlp_endpoint": None,
                "metrics_port": -1,
            }
        )
        # As in every worker: a real tracer provider, so spans cost what they cost there.
        setup_tracing(bench, "bench")
        result: dict[str, Any] = {"events": events, "relays": relays}
        result["nats_server_version"] = await _server_version(bench.nats_url)
        # Relays first, on the broker alone (Postgres is not part of them).
        result.update(await run_relays(bench, relays, log))

        database = await asyncio.to_thread(lambda: EmbeddedPostgres.create(tmp).start())
        await asyncio.to_thread(upgrade, database.url)
        bench = bench.model_copy(update={"database_url": database.url})
        result.update(await run_recorder(bench, events, tmp, log))
        result["cpus"] = os.cpu_count()
        result["python"] = sys.version.split()[0]
        return result
    finally:
        quiet.setLevel(level)
        if database is not None:
            await asyncio.to_thread(database.stop)
        if broker is not None:
            await asyncio.to_thread(broker.stop)
        await asyncio.to_thread(shutil.rmtree, tmp, True)

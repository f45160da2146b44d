"""Bounded KV end to end: the whole system as `mooncake up` runs it (its own broker and
database), engine workers with KV pools far smaller than the work, and a decode worker
killed (-9) while one of its requests is preempted and waiting to resume.

Nothing is lost: every request completes exactly once with the tokens the engine gives it
alone; the record holds the preemptions and resumptions; the record equals what the streams
carried; the projections equal their rebuild; no request failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
import torch
from _faults_harness import (
    FaultStack,
    Supervisor,
    connect,
    record_vs_streams,
    recorder_caught_up,
    running,
    until,
)
from sqlalchemy import text

from mooncake import events as ev
from mooncake.client import ask
from mooncake.config import DummyModel, EngineSettings, GatewaySettings, Settings
from mooncake.db.engine import async_engine
from mooncake.db.rebuild import verify
from mooncake.engine import generate
from mooncake.engine.sampling import SamplingParams as EngineParams
from mooncake.model_info import dummy_spec
from mooncake.services import free_port
from mooncake.serving.models import build_engine

from helpers import endings, lost_or_broken

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

CONTEXT = 1024
REQUESTS = 14
MAX_TOKENS = 400


def settings_for(path: Path) -> Settings:
    engine = EngineSettings(model="dummy", dummy=DummyModel(context=CONTEXT))
    per_token = dummy_spec(engine).kv_bytes_per_token(4)
    return Settings(
        nats_url=f"nats://127.0.0.1:{free_port()}",  # nothing there: the stack starts its own
        database_url=None,
        namespace="mc",
        data_dir=path,
        block_tokens=16,
        engine=engine,
        gateway=GatewaySettings(port=0),
        # ~1.5 contexts per engine worker: two or three of these requests at a time.
        kv_cache_bytes=int(1.5 * (CONTEXT + 32)) * per_token,
    )


@dataclass
class PreemptionWatch:
    """Requests preempted on an instance and not resumed (or ended) yet, from the bus."""

    ns: ev.Namespace
    waiting: dict[str, set[str]] = field(default_factory=dict)  # instance -> request ids
    seen: int = 0
    subs: list[Any] = field(default_factory=list)

    async def start(self, nc: Any) -> None:
        for kind in (ev.DecodePreempted, ev.DecodeResumed, ev.RequestCompleted):
            self.subs.append(await nc.subscribe(self.ns.of(kind), cb=self._on))

    async def _on(self, msg: Any) -> None:
        body = json.loads(msg.data)
        rid = body["request_id"]
        if body["type"] == "request.decode_preempted":
            self.seen += 1
            self.waiting.setdefault(body["instance"], set()).add(rid)
        else:
            for rids in self.waiting.values():
                rids.discard(rid)

    def mid_preemption(self) -> str | None:
        return next((i for i, rids in sorted(self.waiting.items()) if rids), None)


@pytest_asyncio.fixture
async def stack(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[FaultStack]:
    # The workers read the model's shape and their budget from the environment.
    monkeypatch.setenv("MOONCAKE_ENGINE__DUMMY__CONTEXT", str(CONTEXT))
    # Outside /tmp/pytest-of-<user> (see test_faults.data_dir: Postgres must reach it).
    path = Path(tempfile.mkdtemp(prefix="mc-preempt-"))
    async with running(FaultStack(settings_for(path))) as s:
        yield s


def prompt(i: int) -> list[int]:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randint(0, 1024, (200 + 15 * i,), generator=g).tolist()


async def test_kill_decode_mid_preemption_loses_nothing(stack: FaultStack) -> None:
    settings = stack.settings
    ns = ev.Namespace(settings.namespace)
    nc = await connect(stack.nats_url)
    db = async_engine(stack.database_url)
    watch = PreemptionWatch(ns)
    supervisor = Supervisor(stack, delay_s=1.0)
    try:
        await watch.start(nc)
        params = ev.SamplingParams(max_tokens=MAX_TOKENS)

        async def served() -> bool:  # the system is up: one small request end to end
            out = await ask(nc, ns=ns, token_ids=[1, 2, 3], params=ev.SamplingParams(max_tokens=2),
                            timeout_s=10)  # fmt: skip
            return out.finished

        assert await until(served, 180), "the system never served"
        supervisor.start()
        ids = [f"pre-{i}" for i in range(REQUESTS)]
        asks = [
            asyncio.create_task(ask(nc, ns=ns, token_ids=prompt(i), params=params,
                                    request_id=rid, timeout_s=240))
            for i, rid in enumerate(ids)
        ]  # fmt: skip

        async def preempting() -> bool:
            return watch.mid_preemption() is not None

        assert await until(preempting, 120, every=0.01), "no decode instance ever preempted"
        victim = watch.mid_preemption()
        assert victim is not None
        held = sorted(watch.waiting[victim])
        stack.worker(victim).kill()
        killed_at = time.monotonic()
        outcomes = await asyncio.gather(*asks)
        await _check(stack, db, nc, ns, ids, outcomes, watch, victim, held, killed_at)
    finally:
        await supervisor.stop()
        for sub in watch.subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        await nc.close()
        await db.dispose()


async def _check(stack: FaultStack, db: Any, nc: Any, ns: ev.Namespace, ids: list[str],
                 outcomes: list[Any], watch: PreemptionWatch, victim: str, held: list[str],
                 killed_at: float) -> None:  # fmt: skip
    reference = await asyncio.to_thread(build_engine, stack.settings)
    expected = {
        rid: generate(reference, [prompt(i)], [EngineParams(max_tokens=MAX_TOKENS)])[0].tokens
        for i, rid in enumerate(ids)
    }

    async def ended() -> bool:
        return len(await endings(db, ids)) == len(ids)

    assert await until(ended, 60), "not every request ended in the record"
    # Nothing rejected either: the pool had room for every one (preemption made it).
    broken = lost_or_broken(outcomes, await endings(db, ids), expected.__getitem__)
    broken += [f"{o.request_id}: rejected {o.rejected_reason}" for o in outcomes if not o.admitted]
    assert not broken, f"answers lost or wrong after killing {victim} (held {held}): {broken}"

    lasts = None

    async def caught_up() -> bool:
        nonlocal lasts
        lasts = await recorder_caught_up(nc.jetstream(), ns)
        return lasts is not None

    assert await until(caught_up, 60), "the recorder never caught up with the streams"
    assert lasts is not None
    record = await record_vs_streams(nc.jetstream(), db, ns, lasts)
    assert not record.missing_from_record and not record.not_in_streams, record
    assert await verify(db) == []
    async with db.connect() as conn:
        rows = await conn.execute(
            text("SELECT request_id, preemptions FROM requests WHERE request_id = ANY(:ids)"),
            {"ids": ids},
        )
        preemptions = {r: n for r, n in rows}
        kinds = await conn.execute(
            text("SELECT type, count(*) FROM events WHERE request_id = ANY(:ids) GROUP BY type"),
            {"ids": ids},
        )
        by_type = dict(kinds.all())
    assert sum(preemptions.values()) >= 1 and by_type.get("request.decode_preempted", 0) >= 1
    assert by_type.get("request.decode_resumed", 0) >= 1
    logs = stack.logs()
    crashed = {n: t.count("Traceback") for n, t in logs.items() if "Traceback" in t}
    assert not crashed, f"tracebacks in worker logs: {crashed}"
    print(json.dumps({
        "killed": victim, "held_preempted": held, "preempted_events": watch.seen,
        "requests": len(ids), "completed": by_type.get("request.completed", 0),
        "settled_s": round(time.monotonic() - killed_at, 1),
    }))  # fmt: skip

"""Chunked pipeline parallelism live (issue 19, docs/cpp.md): real worker processes
(recorder, store master, Conductor, two prefill and one decode worker), real NATS and
Postgres, the Conductor allowed groups of two.

A long prompt is prefilled by both prefill instances as one pipeline and answers exactly as
one process does; a prompt with a cached prefix is still grouped and loads it; a short one
runs on one instance. A stage killed with -9 in the middle of a group's prefill leaves the
leader to finish the request alone; a killed leader's work goes to the other instance. Every
request ends once, and the record says who prefilled it and, where the group was given up,
why."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client as NATS
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from mooncake import events as ev
from mooncake.client import Outcome, ask
from mooncake.config import DummyModel, EngineSettings, Settings
from mooncake.db.engine import async_engine
from mooncake.engine import Engine, generate
from mooncake.engine.sampling import SamplingParams as EngineParams
from mooncake.serving.models import build_engine
from mooncake.work import LoadReport, WorkSubjects

from helpers import Worker, endings, running_workers, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]

LAYOUT = (
    ("recorder", "recorder-0"),
    ("store-master", "store-master-0"),
    ("conductor", "conductor-0"),
    ("prefill", "prefill-0"),
    ("prefill", "prefill-1"),
    ("decode", "decode-0"),
)
PREFILLS = ("prefill-0", "prefill-1")
# A model large enough that a 2,048-token prefill takes seconds on one thread: the window a
# kill lands in.
DUMMY = DummyModel(vocab=1024, hidden=512, layers=4, heads=8, kv_heads=4, ffn=2048, context=4096)


@dataclass
class System:
    settings: Settings
    workers: dict[str, Worker]
    spans: Path
    engine: Engine

    @property
    def ns(self) -> ev.Namespace:
        return ev.Namespace(self.settings.namespace)

    def expected(self, tokens: list[int], max_tokens: int) -> list[int]:
        return generate(self.engine, [tokens], [EngineParams(max_tokens=max_tokens)])[0].tokens


@pytest.fixture(scope="module")
def system(
    nats_url: str, database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[System]:
    tmp = tmp_path_factory.mktemp("cpp")
    settings = Settings(
        nats_url=nats_url, database_url=database_url, namespace="c" + uuid.uuid4().hex[:10],
        data_dir=tmp / "data", block_tokens=16, engine=EngineSettings(model="dummy", dummy=DUMMY),
    )  # fmt: skip
    spans = tmp / "spans"
    env = {
        "MOONCAKE_BLOCK_TOKENS": "16",
        "MOONCAKE_ENGINE__MODEL": "dummy",
        "MOONCAKE_ENGINE__THREADS": "1",
        **{f"MOONCAKE_ENGINE__DUMMY__{k.upper()}": str(v) for k, v in DUMMY.model_dump().items()},
        "MOONCAKE_STORE__SECRET": "e2e-cpp",
        "MOONCAKE_STORE__DRAM_BYTES": str(256 << 20),
        "MOONCAKE_STORE__HEARTBEAT_S": "0.2",
        "MOONCAKE_STORE__NODE_TIMEOUT_S": "2",
        "MOONCAKE_BUS__ACK_WAIT_S": "3",
        "MOONCAKE_CONDUCTOR__LIVENESS_TIMEOUT_S": "3",
        # Groups of two wherever the (reference) cost model says they pay at all.
        "MOONCAKE_CONDUCTOR__ONLINE_COST": "false",
        "MOONCAKE_CPP__MAX_STAGES": "2",
        "MOONCAKE_CPP__CHUNK_TOKENS": "256",
        "MOONCAKE_CPP__MIN_GAIN": "1.0",
        "MOONCAKE_CPP__MIN_EFFICIENCY": "0.3",
        "MOONCAKE_CPP__GANG_WAIT_S": "20",
        "MOONCAKE_TRACE_DIR": str(spans),
    }
    with running_workers(LAYOUT, settings, tmp / "logs", env) as workers:
        yield System(settings, workers, spans, build_engine(settings))


@pytest_asyncio.fixture
async def nc(system: System) -> AsyncIterator[NATS]:
    conn = await nats.connect(system.settings.nats_url)
    try:
        await wait_for(lambda: _answers(conn, system), 120, "the pipeline to answer")
        # One prefill instance answers; the Conductor groups only instances it has seen.
        await _reported_twice(conn, system, PREFILLS)
        yield conn
    finally:
        await conn.drain()


@pytest_asyncio.fixture
async def db(system: System) -> AsyncIterator[AsyncEngine]:
    assert system.settings.database_url
    eng = async_engine(system.settings.database_url)
    try:
        yield eng
    finally:
        await eng.dispose()


async def _answers(conn: NATS, system: System) -> bool:
    out = await ask(conn, token_ids=[1, 2, 3], ns=system.ns,
                    params=ev.SamplingParams(max_tokens=2), timeout_s=10)  # fmt: skip
    return out.finished


async def _reported_twice(conn: NATS, system: System, instances: tuple[str, ...]) -> None:
    """Until each of `instances` has sent two load reports: alive, and its first report
    (its join) had a report interval to reach the Conductor."""
    seen: dict[str, set[int]] = {i: set() for i in instances}

    async def on_report(msg: Any) -> None:
        r = LoadReport.model_validate_json(msg.data)
        if r.instance in seen:
            seen[r.instance].add(r.seq)

    sub = await conn.subscribe(WorkSubjects(system.ns).load(), cb=on_report)
    try:

        async def reported() -> bool:
            return all(len(s) >= 2 for s in seen.values())

        await wait_for(reported, 120, f"two load reports from each of {instances}")
    finally:
        await sub.unsubscribe()


def _prompt(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + 31 * k) % DUMMY.vocab for k in range(n)]


async def _prefilled(db: AsyncEngine, rid: str) -> dict[str, Any]:
    """The request's `request.prefilled` event, once recorded."""
    found: list[dict[str, Any]] = []

    async def recorded() -> bool:
        async with db.connect() as conn:
            rows = (
                await conn.execute(
                    text(
                        "SELECT payload FROM events WHERE request_id = :r "
                        "AND type = 'request.prefilled'"
                    ),
                    {"r": rid},
                )
            ).all()
        found[:] = [r[0] for r in rows]
        return bool(found)

    await wait_for(recorded, 30, f"{rid}'s prefilled event")
    assert len(found) == 1, found
    return found[0]


async def _ended_once(db: AsyncEngine, rid: str) -> None:
    async def recorded() -> bool:
        return rid in await endings(db, [rid])

    await wait_for(recorded, 30, f"{rid}'s ending in the record")
    assert (await endings(db, [rid]))[rid] == ["request.completed"]


async def _ask(nc: NATS, system: System, tokens: list[int], rid: str) -> Outcome:
    out = await ask(nc, token_ids=tokens, ns=system.ns, request_id=rid,
                    params=ev.SamplingParams(max_tokens=6), timeout_s=180)  # fmt: skip
    assert out.finished, (rid, out.finish_reason, out.error)
    assert out.token_ids == system.expected(tokens, 6), rid
    return out


def _spans(system: System, rid: str) -> list[dict[str, Any]]:
    """Every span of the traces the request's spans are in."""
    spans = [
        json.loads(line)
        for f in system.spans.glob("*.jsonl")
        for line in f.read_text().splitlines()
    ]
    traces = {
        s["context"]["trace_id"] for s in spans if s["attributes"].get("mc.request_id") == rid
    }
    return [s for s in spans if s["context"]["trace_id"] in traces]


async def test_long_prompts_are_prefilled_by_a_group_and_answer_as_one_process(
    system: System, nc: NATS, db: AsyncEngine
) -> None:
    long = _prompt(1024, 1)
    rid = f"cpp-long-{uuid.uuid4().hex[:6]}"
    await _ask(nc, system, long, rid)
    fact = await _prefilled(db, rid)
    assert sorted(fact["stages"]) == list(PREFILLS) and fact["stages"][0] == fact["instance"]
    assert fact.get("cpp_fallback") is None and fact["cached_tokens"] == 0
    await _ended_once(db, rid)
    # The member's stage and each stage's chunks are in the request's trace.
    await asyncio.sleep(1.0)
    spans = _spans(system, rid)
    stage = [s for s in spans if s["name"] == "prefill stage"]
    lead = [s for s in spans if s["name"] == "prefill compute"]
    assert len(stage) == 1 and len(lead) == 1, [s["name"] for s in spans]
    assert stage[0]["context"]["trace_id"] == lead[0]["context"]["trace_id"]
    chunks = [s for s in spans if s["name"] == "cpp chunk"]
    assert len(chunks) == 2 * 4, len(chunks)  # 1,024 tokens in chunks of about 256, 2 stages

    # Its first 512 tokens again, then new ones: still a group, over the cached prefix.
    rid2 = f"cpp-prefix-{uuid.uuid4().hex[:6]}"
    await _ask(nc, system, long[:512] + _prompt(600, 2), rid2)
    fact = await _prefilled(db, rid2)
    assert len(fact["stages"]) == 2 and fact["cached_tokens"] >= 512, fact
    await _ended_once(db, rid2)

    # A short prompt: one instance.
    rid3 = f"cpp-short-{uuid.uuid4().hex[:6]}"
    await _ask(nc, system, _prompt(40, 3), rid3)
    assert (await _prefilled(db, rid3))["stages"] == []
    await _ended_once(db, rid3)


async def _kill_when_prefilling(
    nc: NATS, system: System, tokens: list[int], rid: str, victim: str
) -> tuple[Outcome, str]:
    """Ask `tokens`; once its prefill starts, kill the group's leader (`victim` "leader")
    or its member ("member") with -9. The outcome and the instance killed."""
    started: asyncio.Queue[ev.PrefillStarted] = asyncio.Queue()

    async def on_start(msg: Any) -> None:
        event = ev.parse_event(msg.data)
        if isinstance(event, ev.PrefillStarted) and event.request_id == rid:
            started.put_nowait(event)

    sub = await nc.subscribe(system.ns.of(ev.PrefillStarted), cb=on_start)
    try:
        asking = asyncio.create_task(_ask(nc, system, tokens, rid))
        event = await asyncio.wait_for(started.get(), 60)
        leader = event.instance
        killed = leader if victim == "leader" else next(p for p in PREFILLS if p != leader)
        await asyncio.sleep(0.3)  # the stages are into their chunks
        system.workers[killed].kill()
        return await asyncio.wait_for(asking, 240), killed
    finally:
        await sub.unsubscribe()


async def _groups_again(nc: NATS, system: System, db: AsyncEngine) -> None:
    """After a restart: long prompts are prefilled by groups again."""

    async def grouped() -> bool:
        rid = f"cpp-again-{uuid.uuid4().hex[:6]}"
        await _ask(nc, system, _prompt(1024, int(uuid.uuid4().int % 1000)), rid)
        return len((await _prefilled(db, rid))["stages"]) == 2

    await wait_for(grouped, 120, "a group again after the restart", interval=1.0)


@pytest.mark.parametrize("victim", ["member", "leader"])
async def test_a_stage_killed_mid_prefill_leaves_the_request_to_complete_once(
    system: System, nc: NATS, db: AsyncEngine, victim: str
) -> None:
    """A member killed: the leader gives the group up and finishes alone (the record says
    why). The leader killed: its work goes to the other instance, which prefills alone."""
    rid = f"cpp-kill-{victim}-{uuid.uuid4().hex[:6]}"
    seed = 4 if victim == "member" else 5
    _, killed = await _kill_when_prefilling(nc, system, _prompt(2048, seed), rid, victim)
    fact = await _prefilled(db, rid)
    assert fact["instance"] != killed and fact["stages"] == [], fact
    if victim == "member":
        assert fact["cpp_fallback"], fact  # the record says why
    await _ended_once(db, rid)
    system.workers[killed].start()
    await _groups_again(nc, system, db)

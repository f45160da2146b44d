"""The fault-injection suite's machinery (tests/e2e/test_faults.py): the whole system as
`mooncake up` runs it (its own broker and database), a supervisor that restarts what dies
the way `up` does, trace traffic with per-request timings, recovery probes, and the checks
of the record against the streams.

Sizes come from the environment (`Knobs.from_env`): `make faults` sets MC_FAULTS_FULL=1
(every scenario, more requests, the 30 s Postgres outage); without it `make test` runs a
CI-sized subset.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import nats
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from mooncake import events as ev
from mooncake.bench.record import TERMINAL
from mooncake.client import Outcome, ask
from mooncake.config import Settings
from mooncake.replay_live import LiveReplayOptions, scaled_request
from mooncake.services import EmbeddedNats, EmbeddedPostgres, ServiceError
from mooncake.stack import Stack
from mooncake.trace import TraceRequest

from helpers import endings

# The streams the recorder turns into `events` (MC_DLQ goes to `dead_letters`).
RECORDED_STREAMS = ("MC_REQ", "MC_META")

# What every worker runs with, on top of what `Stack.child_env` gives (`mooncake up`): the
# dummy engine, small store segments, and the failure detectors shortened as in
# tests/e2e/test_pipeline.py, so a crash is noticed in seconds. The recovery times in
# RELIABILITY.md are measured with exactly these.
WORKER_ENV = {
    "MOONCAKE_ENGINE__MODEL": "dummy",
    "MOONCAKE_ENGINE__THREADS": "1",
    # KV pools touched as they fill, as when RELIABILITY.md's recovery times were measured
    # (`up` maps them at start: a restarted worker would zero its whole pool first).
    "MOONCAKE_ENGINE__PREFAULT_KV": "false",
    "MOONCAKE_STORE__DRAM_BYTES": str(64 << 20),
    "MOONCAKE_STORE__HEARTBEAT_S": "0.2",
    "MOONCAKE_STORE__NODE_TIMEOUT_S": "2",
    # A killed worker's unacked work is redelivered after this long.
    "MOONCAKE_BUS__ACK_WAIT_S": "3",
    "MOONCAKE_CONDUCTOR__LIVENESS_TIMEOUT_S": "3",
}


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    return float(raw) if raw else default


@dataclass(frozen=True)
class Knobs:
    """How big a run is. CI: a subset of scenarios, fewer requests, a short outage."""

    full: bool
    requests: int
    speed: float
    max_output_tokens: int
    pg_outage_s: float
    restart_delay_s: float
    # A request submitted after the fault must be served within this long.
    recovery_bound_s: float
    request_timeout_s: float
    out: Path

    @classmethod
    def from_env(cls) -> Knobs:
        full = os.environ.get("MC_FAULTS_FULL", "") not in ("", "0")
        default_out = Path(tempfile.gettempdir()) / "mooncake-faults.jsonl"
        return cls(
            full=full,
            requests=int(_env_float("MC_FAULTS_REQUESTS", 80 if full else 40)),
            # The conversation trace's first 80 arrivals span 27 s: about 20 s at 1.3x.
            speed=_env_float("MC_FAULTS_SPEED", 1.3),
            max_output_tokens=16,
            pg_outage_s=_env_float("MC_FAULTS_PG_OUTAGE_S", 30.0 if full else 8.0),
            restart_delay_s=_env_float("MC_FAULTS_RESTART_DELAY_S", 1.0),
            recovery_bound_s=_env_float("MC_FAULTS_RECOVERY_BOUND_S", 45.0),
            request_timeout_s=_env_float("MC_FAULTS_REQUEST_TIMEOUT_S", 90.0),
            out=Path(os.environ.get("MC_FAULTS_OUT") or default_out),
        )


class FaultStack(Stack):
    """`mooncake up`'s Stack with the workers' test settings and a parallel shutdown."""

    def child_env(self) -> dict[str, str]:
        return super().child_env() | WORKER_ENV

    def shutdown(self) -> None:
        for w in self.workers:  # SIGTERM to all at once, then wait: seconds, not one each
            if w.running and w.proc is not None:
                w.proc.send_signal(signal.SIGTERM)
        for w in self.workers:
            if w.proc is None:
                continue
            try:
                w.proc.wait(20)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait(5)
        self.stop()

    def logs(self) -> dict[str, str]:
        logs = self.settings.data_dir / "logs"
        return {p.stem: p.read_text(errors="replace") for p in sorted(logs.glob("*.log"))}


@contextlib.asynccontextmanager
async def running(stack: FaultStack) -> AsyncIterator[FaultStack]:
    """`stack` with its infrastructure and workers started; shut down after, and its data
    directory removed."""
    await asyncio.to_thread(stack.start_infrastructure)
    stack.start_workers()
    try:
        yield stack
    finally:
        await asyncio.to_thread(stack.shutdown)
        shutil.rmtree(stack.settings.data_dir, ignore_errors=True)


@dataclass
class Supervisor:
    """What `mooncake up` does while it runs (cli._wait_for_signal): a worker that exited is
    restarted through `Stack.restart`; here after `delay_s`, so a fault lasts a moment."""

    stack: FaultStack
    delay_s: float
    restarts: list[tuple[str, float]] = field(default_factory=list)
    _task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        dead_since: dict[str, float] = {}
        while True:
            await asyncio.sleep(0.2)
            now = time.monotonic()
            for w in list(self.stack.workers):
                if w.running:
                    continue
                since = dead_since.setdefault(w.name, now)
                if now - since >= self.delay_s:
                    del dead_since[w.name]
                    await asyncio.to_thread(self.stack.restart, w)
                    self.restarts.append((w.name, time.monotonic()))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


async def restart(server: EmbeddedNats | EmbeddedPostgres) -> None:
    """Start a stopped server again (same port, same data); its log's tail if it fails."""
    try:
        await asyncio.to_thread(server.start)
    except ServiceError as exc:
        tail = server.log_path.read_text(errors="replace")[-3000:]
        raise AssertionError(f"{server.name} did not start again: {exc}\n{tail}") from exc


async def connect(url: str) -> NATS:
    """A client that outlives a broker restart (reconnects forever, quickly)."""
    return await nats.connect(
        url, max_reconnect_attempts=-1, reconnect_time_wait=0.25, connect_timeout=3
    )


@dataclass
class Traffic:
    """Trace requests submitted at their (scaled) arrival times, all in flight at once, as
    `mooncake replay` does (same token construction), with each one's start and end."""

    nc: NATS
    settings: Settings
    trace: list[TraceRequest]
    opts: LiveReplayOptions
    prefix: str
    started: dict[str, float] = field(default_factory=dict)
    ended: dict[str, float] = field(default_factory=dict)
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    requests: dict[str, tuple[list[int], ev.SamplingParams]] = field(default_factory=dict)

    def rid(self, i: int) -> str:
        return f"{self.prefix}-{i}"

    async def run(self) -> None:
        ns = ev.Namespace(self.settings.namespace)
        begin = time.monotonic()
        t0 = self.trace[0].arrival_s

        async def one(i: int, req: TraceRequest) -> None:
            delay = (req.arrival_s - t0) / self.opts.speed - (time.monotonic() - begin)
            if delay > 0:
                await asyncio.sleep(delay)
            rid = self.rid(i)
            tokens, params = scaled_request(req, self.opts, self.settings.hash_seed)
            self.requests[rid] = (tokens, params)
            self.started[rid] = time.monotonic()
            try:
                out = await ask(
                    self.nc, token_ids=tokens, params=params, ns=ns, request_id=rid,
                    timeout_s=self.opts.timeout_s,
                )  # fmt: skip
                self.outcomes[rid] = out
            except Exception as exc:  # the submission itself failed
                self.errors[rid] = f"{type(exc).__name__}: {exc}"
            self.ended[rid] = time.monotonic()

        await asyncio.gather(*(one(i, r) for i, r in enumerate(self.trace)))

    def in_flight(self, at: float) -> list[str]:
        return [r for r, t in self.started.items() if t <= at and self.ended.get(r, 1e18) > at]

    @property
    def ids(self) -> list[str]:
        return [self.rid(i) for i in range(len(self.trace))]


@dataclass
class StageWatch:
    """Where each request's work is, as the bus says (the lifecycle events also reach core
    subscribers): a prefill or decode started on an instance and not yet handed on or ended.
    It picks the busiest instance to kill and counts the work a kill interrupted."""

    ns: ev.Namespace
    active: dict[str, tuple[str, str]] = field(default_factory=dict)  # rid -> (stage, instance)
    starts: Counter[tuple[str, str]] = field(default_factory=Counter)  # (rid, stage) -> times
    _subs: list[Any] = field(default_factory=list)

    async def start(self, nc: NATS) -> None:
        handoffs = (
            ev.PrefillStarted, ev.RequestPrefilled, ev.DecodeStarted, ev.RequestCompleted,
            ev.RequestFailed, ev.RequestCancelled,
        )  # fmt: skip
        for kind in handoffs:
            self._subs.append(await nc.subscribe(self.ns.of(kind), cb=self._seen))

    async def _seen(self, msg: Any) -> None:
        with contextlib.suppress(ValueError, KeyError, TypeError):
            body = json.loads(msg.data)
            rid, kind = str(body["request_id"]), str(body["type"])
            if kind in ("request.prefill_started", "request.decode_started"):
                stage = kind.split(".")[1].removesuffix("_started")
                self.active[rid] = (stage, str(body["instance"]))
                self.starts[(rid, stage)] += 1
            else:
                self.active.pop(rid, None)

    def on(self, instance: str) -> list[str]:
        return [rid for rid, (_, where) in self.active.items() if where == instance]

    def busiest(self, role: str, instances: list[str]) -> tuple[str, int]:
        load = {i: len(self.on(i)) for i in instances if i.startswith(role)}
        name = max(sorted(load), key=lambda i: load[i])
        return name, load[name]

    def started_again(self) -> int:
        """Requests whose prefill or decode started more than once (redelivered or
        re-dispatched after the fault)."""
        return len({rid for (rid, _), n in self.starts.items() if n > 1})

    async def stop(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


@dataclass
class Probes:
    """Small requests submitted one after another from the moment of the fault until one
    is served: `served_s` is when the first finished, measured from `t0`."""

    submit: Callable[[str], Awaitable[bool]]
    prefix: str
    t0: float
    every_s: float = 0.5
    served_s: float | None = None
    ids: list[str] = field(default_factory=list)
    attempts: int = 0

    async def run(self, within_s: float) -> None:
        tasks: list[asyncio.Task[None]] = []

        async def one(rid: str) -> None:
            if await self.submit(rid) and self.served_s is None:
                self.served_s = time.monotonic() - self.t0

        while self.served_s is None and time.monotonic() - self.t0 < within_s:
            rid = f"{self.prefix}-{len(self.ids)}"
            self.ids.append(rid)
            tasks.append(asyncio.create_task(one(rid)))
            await asyncio.sleep(self.every_s)
        # The probes still out finish (or time out) too: each is a request of the record.
        await asyncio.gather(*tasks, return_exceptions=True)


def bus_probe(nc: NATS, settings: Settings, timeout_s: float) -> Callable[[str], Awaitable[bool]]:
    ns = ev.Namespace(settings.namespace)

    async def submit(rid: str) -> bool:
        try:
            out = await ask(
                nc, token_ids=[11, 12, 13, 14, 15], ns=ns, request_id=rid,
                params=ev.SamplingParams(max_tokens=2), timeout_s=timeout_s,
            )  # fmt: skip
        except Exception:
            return False
        return out.finished

    return submit


def http_probe(base_url: str, model: str, timeout_s: float) -> Callable[[str], Awaitable[bool]]:
    """A completion through the gateway (its request id is the gateway's own)."""

    async def submit(_rid: str) -> bool:
        body = {"model": model, "prompt": [21, 22, 23, 24], "max_tokens": 2}
        try:
            async with httpx.AsyncClient(timeout=timeout_s) as client:
                r = await client.post(f"{base_url}/completions", json=body)
        except httpx.HTTPError:
            return False
        return r.status_code == 200 and bool(r.json().get("choices"))

    return submit


# --- the record against the streams ------------------------------------------------------


async def read_stream(js: JetStreamContext, stream: str, upto: int) -> list[tuple[int, str, str]]:
    """(seq, event id in the payload, Nats-Msg-Id) of every message up to `upto`."""
    if upto == 0:
        return []
    info = await js.add_consumer(
        stream,
        ConsumerConfig(
            ack_policy=AckPolicy.NONE,
            deliver_policy=DeliverPolicy.ALL,
            inactive_threshold=60.0,
            max_ack_pending=-1,
        ),
    )
    sub = await js.pull_subscribe_bind(consumer=info.name, stream=stream)
    out: list[tuple[int, str, str]] = []
    newest = 0
    try:
        while newest < upto:
            for msg in await sub.fetch(1000, timeout=5):
                seq = msg.metadata.sequence.stream
                newest = max(newest, seq)
                if seq <= upto:
                    body = json.loads(msg.data)
                    msg_id = (msg.headers or {}).get("Nats-Msg-Id", "")
                    out.append((seq, str(body.get("event_id")), msg_id))
    finally:
        await sub.unsubscribe()
        with contextlib.suppress(Exception):
            await js.delete_consumer(stream, info.name)
    return out


async def recorder_caught_up(js: JetStreamContext, ns: ev.Namespace) -> dict[str, int] | None:
    """Each recorded stream's last sequence, once the recorder has acked everything up to
    it (so every message up to there is committed to Postgres); None while it has not."""
    lasts: dict[str, int] = {}
    for name in RECORDED_STREAMS:
        stream = ns.stream(name)
        last = (await js.stream_info(stream)).state.last_seq
        consumer = await js.consumer_info(stream, "recorder")
        if consumer.num_ack_pending or consumer.num_pending:
            return None
        if (consumer.ack_floor.stream_seq if consumer.ack_floor else 0) < last:
            return None
        lasts[name] = last
    return lasts


@dataclass
class RecordCheck:
    stream_messages: int
    events_rows: int  # rows of the compared range (up to each stream's compared sequence)
    missing_from_record: list[str]  # carried by a stream, not in `events`
    not_in_streams: list[str]  # in `events`, carried by no stream
    # Stream sequences the record holds no row for, and rows whose sequence no message has
    # (a row recorded under the wrong sequence shows in both).
    sequence_gaps: list[int]
    stray_sequences: list[int]
    stream_duplicates: list[str]  # event ids more than one message carried (dedupe missed)
    msg_id_mismatches: int  # Nats-Msg-Id differs from the payload's event id

    @property
    def violations(self) -> list[str]:
        found = []
        if self.missing_from_record:
            found.append(f"carried but not recorded: {self.missing_from_record[:10]}")
        if self.not_in_streams:
            found.append(f"recorded but not carried: {self.not_in_streams[:10]}")
        if self.sequence_gaps or self.stray_sequences:
            found.append(
                f"record sequences: gaps {self.sequence_gaps[:10]}, "
                f"strays {self.stray_sequences[:10]}"
            )
        if self.stream_duplicates:
            found.append(f"carried twice: {self.stream_duplicates[:10]}")
        if self.msg_id_mismatches:
            found.append(f"{self.msg_id_mismatches} message ids differ from their event ids")
        return found


@dataclass
class Promise:
    """What a fault run found against RELIABILITY.md's promise: every request the test
    submitted is recorded and ends exactly once, completed (with the engine's own answer) or
    rejected with a reason, never failed; its client hears the ending; the record equals
    what the streams carried."""

    settled: bool
    never_recorded: list[str]
    lost: list[str]  # no terminal event
    duplicated: list[str]  # more than one
    orphans: list[str]  # an ending without a submission
    wrong: list[str]  # answers that differ from the engine's (short ones included)
    failed: list[str]
    unanswered: list[str]
    record: RecordCheck

    @property
    def violations(self) -> list[str]:
        found = [] if self.settled else ["not every submitted request ended within 120 s"]
        for what, ids in (
            ("submitted but never recorded", self.never_recorded),
            ("no terminal event", self.lost),
            ("more than one terminal event", self.duplicated),
            ("terminal event without a submission", self.orphans),
            ("answers differ from the engine's", self.wrong),
            # No fault is a reason to fail a request: its work is re-dispatched.
            ("requests ended failed", self.failed),
            # Live replies are core NATS: a broker restart drops those in flight, and the
            # client reads its ending back from the request's copy (`client.ask`).
            ("clients that never heard an ending", self.unanswered),
        ):
            if ids:
                found.append(f"{what}: {ids[:10]}")
        return found + self.record.violations


async def record_vs_streams(
    js: JetStreamContext, engine: AsyncEngine, ns: ev.Namespace, lasts: dict[str, int]
) -> RecordCheck:
    carried: list[str] = []
    mismatches = 0
    table: list[str] = []
    gaps: list[int] = []
    strays: list[int] = []
    async with engine.connect() as conn:
        for name, last in lasts.items():
            stream = ns.stream(name)
            msgs = await read_stream(js, stream, last)
            assert [m[0] for m in msgs] == sorted({m[0] for m in msgs}), "stream read twice"
            carried += [eid for _, eid, _ in msgs]
            mismatches += sum(1 for _, eid, mid in msgs if eid != mid)
            rows = list(
                await conn.execute(
                    text(
                        "SELECT event_id, stream_seq FROM events "
                        "WHERE stream = :s AND stream_seq <= :last"
                    ),
                    {"s": stream, "last": last},
                )
            )
            table += [r[0] for r in rows]
            # A later copy of an event is rightly not recorded: only first carriers count.
            firsts: dict[str, int] = {}
            for seq, eid, _ in msgs:
                firsts.setdefault(eid, seq)
            recorded = {int(r[1]) for r in rows}
            gaps += sorted(set(firsts.values()) - recorded)
            strays += sorted(recorded - {m[0] for m in msgs})
    carried_set, table_set = set(carried), set(table)
    twice = sorted(eid for eid, n in Counter(carried).items() if n > 1)
    return RecordCheck(
        stream_messages=len(carried),
        events_rows=len(table),
        missing_from_record=sorted(carried_set - table_set),
        not_in_streams=sorted(table_set - carried_set),
        sequence_gaps=gaps,
        stray_sequences=strays,
        stream_duplicates=twice,
        msg_id_mismatches=mismatches,
    )


async def terminal_counts(engine: AsyncEngine) -> tuple[set[str], dict[str, int]]:
    """Every request the record saw submitted, and its number of terminal events."""
    async with engine.connect() as conn:
        submitted = {
            r[0]
            for r in await conn.execute(
                text("SELECT DISTINCT request_id FROM events WHERE type = 'request.submitted'")
            )
        }
        rows = await conn.execute(
            text(
                "SELECT request_id, count(*) FROM events WHERE type = ANY(:t) GROUP BY request_id"
            ),
            {"t": list(TERMINAL)},
        )
        counts = {rid: int(n) for rid, n in rows}
    return submitted, counts


async def terminal_types(engine: AsyncEngine, ids: list[str]) -> Counter[str]:
    """The terminal events of `ids` in the record, counted by type."""
    return Counter(t for types in (await endings(engine, ids)).values() for t in types)


async def failures(engine: AsyncEngine, ids: list[str]) -> list[str]:
    """Which of `ids` the record ended `failed`, each with its stage, reason and detail (what
    a red run needs to say)."""
    async with engine.connect() as conn:
        rows = await conn.execute(
            text(
                "SELECT request_id, payload->>'stage', payload->>'reason', payload->>'detail' "
                "FROM events WHERE request_id = ANY(:ids) AND type = 'request.failed'"
            ),
            {"ids": ids},
        )
        return sorted(f"{r} ({stage} {reason}: {(detail or '')[:160]})"
                      for r, stage, reason, detail in rows)  # fmt: skip


async def redispatched_requests(engine: AsyncEngine) -> int:
    """Requests whose prefill or decode the record shows started more than once: a start's
    event id holds its attempt, so these are the Conductor's re-dispatches (a redelivery of
    the same attempt repeats the same id, recorded once)."""
    async with engine.connect() as conn:
        n = (
            await conn.execute(
                text(
                    "SELECT count(DISTINCT request_id) FROM (SELECT request_id FROM events "
                    "WHERE type IN ('request.prefill_started', 'request.decode_started') "
                    "GROUP BY request_id, type HAVING count(*) > 1) AS again"
                )
            )
        ).scalar_one()
    return int(n)


async def first_recorded_at(engine: AsyncEngine, ids: list[str]) -> float | None:
    """Wall-clock time (epoch seconds) the first of `ids` had its terminal event recorded."""
    if not ids:
        return None
    async with engine.connect() as conn:
        at = (
            await conn.execute(
                text(
                    "SELECT min(extract(epoch FROM recorded_at)) FROM events "
                    "WHERE request_id = ANY(:ids) AND type = ANY(:t)"
                ),
                {"ids": ids, "t": list(TERMINAL)},
            )
        ).scalar_one()
    return None if at is None else float(at)


async def submitted_since(engine: AsyncEngine, since: float, known: set[str]) -> list[str]:
    """Requests submitted at or after `since` (epoch seconds) that the test did not name."""
    async with engine.connect() as conn:
        rows = await conn.execute(
            text(
                "SELECT DISTINCT request_id FROM events WHERE type = 'request.submitted' "
                "AND occurred_at >= to_timestamp(:t)"
            ),
            {"t": since},
        )
        return sorted(r[0] for r in rows if r[0] not in known)


async def gateway_request_ids(engine: AsyncEngine, known: set[str]) -> list[str]:
    """Requests of the record that the test did not submit itself (the gateway's)."""
    async with engine.connect() as conn:
        rows = await conn.execute(
            text("SELECT DISTINCT request_id FROM events WHERE type = 'request.submitted'")
        )
        return sorted(r[0] for r in rows if r[0] not in known)


async def until(
    predicate: Callable[[], Awaitable[bool]], within_s: float, every: float = 0.5
) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if await predicate():
                return True
        await asyncio.sleep(every)
    return False


def write_result(path: Path, row: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row, sort_keys=True) + "\n")


def record_dict(check: RecordCheck) -> dict[str, Any]:
    d = asdict(check)
    for name in ("missing_from_record", "not_in_streams", "sequence_gaps", "stray_sequences",
                 "stream_duplicates"):  # fmt: skip
        d[name] = len(getattr(check, name))
    return d

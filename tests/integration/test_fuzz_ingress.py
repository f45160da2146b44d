"""Fuzzing every ingress of the pipeline's bus side with hypothesis, against a real NATS.

- Submissions (`mc.req.submitted`) and cancels (`mc.req.cancel`) into a Conductor running in
  this process (the worker's own `start_conductor`, fake instances by load report): each
  fuzzed message is handed to the Conductor's batch handler as JetStream delivers it. The
  law: the outcome is an ack (the request was decided: rejected with a reason, or, when the
  mutation left it valid, admitted) or a dead letter with a reason, never a retry (a retry is
  what an exception inside the handler becomes); a message whose request id can be read gets
  exactly one decision event; and the Conductor still admits a good request afterwards.
- The Conductor's core-NATS inputs (load reports, KV index events, lifecycle facts), with
  hostile values as well as garbage: it goes on admitting.
- The same submissions through the broker into real `conductor` and `recorder` processes:
  every message is accounted for in the record (a decision event, or a dead letter at its
  stream sequence), the process survives, the next good request is admitted.
- Store control: the master's requests built from valid ones with one field mutated (the
  structure-blind fuzz of tests/integration/test_store.py::test_fuzzed_control_requests_...
  covers random JSON), and a node's `move` and `changes` subjects; afterwards a put and a
  get still work. Transfer frames: tests/unit/store/test_frames.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import psycopg
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from mooncake import events as ev
from mooncake.bus.connection import ensure_streams
from mooncake.bus.consume import Ack, DeadLetter, Delivery, Retry
from mooncake.bus.publish import MSG_ID, Publisher
from mooncake.config import BusSettings, ConductorSettings, EngineSettings, Settings
from mooncake.store import protocol as p
from mooncake.store.client import ClientConfig, StoreClient
from mooncake.store.master import StoreMaster, new_state
from mooncake.store.node import NodeConfig, StoreNode
from mooncake.work import LoadReport, WorkSubjects
from workers import conductor as conductor_worker
from workers.runtime import WorkerContext

from helpers import Worker

pytestmark = pytest.mark.integration

MAX_EVENT_BYTES = 4096  # small, so oversize payloads are cheap to make
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
_ids = itertools.count()


def fresh_id(prefix: str = "fz") -> str:
    return f"{prefix}-{os.getpid()}-{next(_ids)}"


# --- what to send ---------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=10,
)
odd = st.one_of(
    json_values,
    st.sampled_from([0, -1, 2**63, 2**64, -(2**64), 1e308, "", "\x00", "a" * 3000, [], {},
                     [-1], [2**40], ["x"], [[1]], True, "request.admitted", "mc.req.>",
                     "2024-13-45T99:99:99Z", "NaN"]),
)  # fmt: skip


def mutated(base: dict[str, Any], keep: tuple[str, ...] = ()) -> st.SearchStrategy[Any]:
    """`base` with one field (not in `keep`) set to something odd or removed, or a field
    added, or a nested field of `params` changed."""
    keys = st.sampled_from(sorted(k for k in base if k not in keep))
    return st.one_of(
        st.builds(lambda k, v: base | {k: v}, keys, odd),
        st.builds(lambda k: {x: y for x, y in base.items() if x != k}, keys),
        st.builds(lambda k, v: base | {k: v}, st.text(min_size=1, max_size=12), odd),
        st.builds(
            lambda k, v: base | {"params": {**base.get("params", {}), k: v}},
            st.sampled_from(
                [
                    "max_tokens",
                    "temperature",
                    "top_p",
                    "top_k",
                    "seed",
                    "stop",
                    "stop_token_ids",
                    "bogus",
                ]
            ),
            odd,
        ),
    )


def submitted_base(rid: str) -> dict[str, Any]:
    return {
        "type": "request.submitted", "event_id": uuid.uuid4().hex, "request_id": rid,
        "token_ids": [5, 6, 7, 8, 9], "params": {"max_tokens": 2}, "slo_class": "default",
        "client_id": "fuzzer", "reply_to": "fz.reply", "deadline_s": 30.0,
    }  # fmt: skip


@dataclass(frozen=True)
class Sample:
    data: bytes
    request_id: str | None  # set when the message names its request readably


def submissions(rid: str) -> st.SearchStrategy[Sample]:
    """What a careless or hostile client may publish on `mc.req.submitted`."""
    base = submitted_base(rid)
    readable = st.one_of(
        mutated(base, keep=("request_id",)).map(lambda d: json.dumps(d).encode()),
        st.just(json.dumps(base | {"token_ids": list(range(MAX_EVENT_BYTES))}).encode()),
        st.just(json.dumps(base | {"prompt": "p", "token_ids": None}).encode()),
        st.just(json.dumps(base | {"type": "request.admitted", "policy": "x"}).encode()),
    ).map(lambda b: Sample(b, rid))
    unreadable = st.one_of(
        st.binary(max_size=300),
        json_values.map(lambda v: json.dumps(v).encode()),
        st.builds(
            lambda cut: json.dumps(base).encode()[:cut],
            st.integers(0, 40),  # cut before the request id
        ),
        st.just(json.dumps({k: v for k, v in base.items() if k != "request_id"}).encode()),
        st.just(json.dumps(base | {"request_id": "has spaces/and/slashes"}).encode()),
    ).map(lambda b: Sample(b, None))
    return st.one_of(readable, unreadable)


def cancels(rid: str) -> st.SearchStrategy[bytes]:
    base = {"type": "request.cancel_requested", "event_id": uuid.uuid4().hex,
            "request_id": rid, "reason": "client"}  # fmt: skip
    return st.one_of(
        mutated(base).map(lambda d: json.dumps(d).encode()),
        st.binary(max_size=200),
        json_values.map(lambda v: json.dumps(v).encode()),
        st.just(json.dumps(base | {"reason": "x" * 5000}).encode()),
    )


# --- a Conductor in this process ------------------------------------------------------------------


@dataclass
class Live:
    loop: asyncio.AbstractEventLoop
    nc: NATS
    settings: Settings
    conductor: conductor_worker.Conductor
    heard: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))
    seq: int = 0

    @property
    def ns(self) -> ev.Namespace:
        return ev.Namespace(self.settings.namespace)

    def delivery(self, data: bytes, subject: str, msg_id: str | None = None) -> Delivery:
        """A message as JetStream delivers it to the Conductor's consumer."""
        self.seq += 1
        stream = self.ns.stream("MC_REQ")
        reply = f"$JS.ACK.{stream}.conductor.1.{self.seq}.{self.seq}.{time.time_ns()}.0"
        headers = {MSG_ID: msg_id} if msg_id else None
        return Delivery(Msg(self.nc, subject=subject, reply=reply, data=data, headers=headers))

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    async def report(self, instance: str, role: str, seq: int = 1, **kw: Any) -> None:
        r = LoadReport(instance=instance, role=role, node=instance, seq=seq, at=time.time(), **kw)
        await self.nc.publish(WorkSubjects(self.ns).load(instance), r.to_json())

    def decide(self, data: bytes) -> Any:
        subject = self.ns.of(ev.RequestSubmitted)
        d = self.delivery(data, subject, msg_id=uuid.uuid4().hex)
        outcomes = self.run(self.conductor.handle_batch([d]))
        assert len(outcomes) == 1
        return outcomes[0]

    def until(self, check: Callable[[], bool], within_s: float = 10.0) -> bool:
        """Run the loop until `check()` holds (what the subscriptions heard), at most
        `within_s`: waited for, never slept on."""

        async def wait() -> bool:
            deadline = time.monotonic() + within_s
            while not check():
                if time.monotonic() > deadline:
                    return False
                await asyncio.sleep(0.005)
            return True

        return bool(self.run(wait()))

    def decisions(self, rid: str) -> list[dict[str, Any]]:
        """The decisions heard for `rid`, once one has reached this process's subscription
        (each is published before `decide` returns)."""

        def decided() -> list[dict[str, Any]]:
            return [e for e in self.heard[rid] if e["type"] != "request.cancelled"]

        self.until(lambda: bool(decided()))
        return decided()

    def admits_a_good_request(self) -> None:
        rid = fresh_id("good")
        outcome = self.decide(json.dumps(submitted_base(rid)).encode())
        assert isinstance(outcome, Ack), outcome
        assert [e["type"] for e in self.decisions(rid)] == ["request.admitted"], self.heard[rid]


@pytest.fixture(scope="module")
def live(nats_url: str) -> Iterator[Live]:
    loop = asyncio.new_event_loop()
    s = Settings(
        _env_file=None,  # type: ignore[call-arg]
        nats_url=nats_url,
        namespace="fz" + uuid.uuid4().hex[:10],
        block_tokens=16,
        engine=EngineSettings(model="dummy"),
        bus=BusSettings(max_event_bytes=MAX_EVENT_BYTES),
        # One report keeps the fake instances alive; the client limit stays out of the way.
        conductor=ConductorSettings(liveness_timeout_s=3600, client_rate_per_s=0),
    )

    async def setup() -> Live:
        nc = await nats.connect(s.nats_url)
        js = nc.jetstream()
        await ensure_streams(js, s)
        ns = ev.Namespace(s.namespace)
        ctx = WorkerContext(s, "conductor", "c0", nc, js, Publisher(nc, js, ns), ns,
                            asyncio.Event(), None)  # fmt: skip
        conductor = await conductor_worker.start_conductor(ctx)
        lv = Live(loop, nc, s, conductor)

        async def heard(msg: Msg) -> None:
            body = json.loads(msg.data)
            lv.heard[str(body.get("request_id"))].append(body)

        for event in (ev.RequestAdmitted, ev.RequestRejected, ev.RequestCancelled):
            await nc.subscribe(ns.of(event), cb=heard)
        await lv.report("p0", "prefill")
        await lv.report("d0", "decode")
        for _ in range(100):
            if "p0" in conductor.view.prefill and "d0" in conductor.view.decode:
                break
            await asyncio.sleep(0.05)
        return lv

    lv = loop.run_until_complete(setup())
    yield lv

    async def teardown() -> None:
        await lv.conductor.stop()
        await lv.nc.drain()

    loop.run_until_complete(teardown())
    loop.close()


def test_a_reply_to_inside_the_system_is_refused_without_publishing_there(live: Live) -> None:
    """A client names the cancel subject as its reply_to: the decision would be published
    there for it. The submission is rejected, and nothing lands on that subject."""
    target = live.ns.of(ev.CancelRequested)
    landed: list[bytes] = []

    async def listen(msg: Msg) -> None:
        landed.append(msg.data)

    sub = live.run(live.nc.subscribe(target, cb=listen))
    rid = fresh_id("hijack")
    outcome = live.decide(json.dumps(submitted_base(rid) | {"reply_to": target}).encode())
    assert isinstance(outcome, Ack), outcome
    [rejected] = live.decisions(rid)
    live.run(sub.unsubscribe())
    assert (rejected["type"], rejected["reason"]) == ("request.rejected", "invalid_request")
    assert "reply_to" in rejected["detail"], rejected
    assert landed == []
    live.admits_a_good_request()


@pytest.mark.parametrize(
    "mutation",
    [
        {"params": {"max_tokens": 0}},
        {"prompt": "a\ud800b", "token_ids": None},  # a lone surrogate: not text
        {"slo_class": "no spaces allowed"},
        {"unknown_field": 1},
        # Past what a torch generator takes: it was admitted, then failed every prefill try.
        {"params": {"max_tokens": 2, "temperature": 1.0, "seed": 2**64}},
    ],
)
def test_an_invalid_submission_is_told_to_its_reply_to(
    live: Live, mutation: dict[str, Any]
) -> None:
    """A submission that does not validate but names its request and its reply_to readably:
    the rejection is recorded and the submitter hears it (it would otherwise wait out its
    timeout for an answer that never comes)."""
    rid, inbox = fresh_id("told"), f"fz.told.{uuid.uuid4().hex}"
    got: list[dict[str, Any]] = []

    async def listen(msg: Msg) -> None:
        got.append(json.loads(msg.data))

    sub = live.run(live.nc.subscribe(inbox, cb=listen))
    body = {k: v for k, v in (submitted_base(rid) | {"reply_to": inbox} | mutation).items()
            if v is not None}  # fmt: skip
    outcome = live.decide(json.dumps(body).encode())
    assert isinstance(outcome, Ack), outcome
    live.until(lambda: bool(got) and bool(live.heard[rid]))
    live.run(sub.unsubscribe())
    [told] = got
    assert (told["type"], told["request_id"], told["reason"]) == (
        "request.rejected", rid, "invalid_request",
    )  # fmt: skip
    [recorded] = live.heard[rid]
    assert told["detail"] and (told["event_id"], told["detail"]) == (
        recorded["event_id"], recorded["detail"],
    )  # fmt: skip


def test_a_submission_nested_past_pythons_stack_is_rejected_not_retried(live: Live) -> None:
    """JSON nested 1,800 deep (under the size limit): pydantic refuses it, and the
    second look for a lone surrogate (`json.loads`) raised RecursionError, a retry."""
    rid = fresh_id("deep")
    head = json.dumps(submitted_base(rid)).encode()[:-1]
    outcome = live.decide(head + b', "x": ' + b"[" * 1800 + b"]" * 1800 + b"}")
    assert isinstance(outcome, Ack), outcome
    [rejected] = live.decisions(rid)
    assert (rejected["type"], rejected["reason"]) == ("request.rejected", "invalid_request")
    assert "recursion limit" in rejected["detail"], rejected
    live.admits_a_good_request()


@FUZZ
@given(data=st.data())
def test_fuzzed_submissions_are_decided_or_dead_lettered_never_retried(
    live: Live, data: st.DataObject
) -> None:
    rid = fresh_id()
    sample = data.draw(submissions(rid))
    outcome = live.decide(sample.data)
    assert isinstance(outcome, Ack | DeadLetter), (outcome, sample)
    if isinstance(outcome, DeadLetter):
        assert outcome.reason in ("invalid_request", "payload_too_large"), outcome
        assert sample.request_id is None, f"{rid} is readable, yet nobody is told: {sample}"
        return
    if sample.request_id is not None:
        decisions = live.decisions(rid)
        assert len(decisions) == 1, (decisions, sample)
        if decisions[0]["type"] == "request.rejected":
            assert decisions[0]["reason"] in {r.value for r in ev.RejectReason}


def test_the_conductor_still_admits_after_the_submission_fuzz(live: Live) -> None:
    live.admits_a_good_request()


@FUZZ
@given(data=st.data())
def test_fuzzed_cancels_are_acked_or_dead_lettered(live: Live, data: st.DataObject) -> None:
    rid = fresh_id("cx")
    payload = data.draw(cancels(rid))
    d = live.delivery(payload, live.ns.subject(ev.CancelRequested.SUBJECT))
    outcome = live.run(live.conductor.cancel(d))  # raises: the test fails
    assert isinstance(outcome, Ack | DeadLetter), outcome
    if isinstance(outcome, DeadLetter):
        assert outcome.reason == "invalid_request"


def test_a_cancel_for_an_admitted_request_still_ends_it_once(live: Live) -> None:
    rid = fresh_id("good")
    assert isinstance(live.decide(json.dumps(submitted_base(rid)).encode()), Ack)
    again = ev.CancelRequested(request_id=rid, reason="fuzz")
    # The same cancel redelivered, then another one: one end, under one event id (a repeat
    # is published again under that id, and the broker's dedupe drops it).
    for cancel in (again, again, ev.CancelRequested(request_id=rid, reason="other")):
        d = live.delivery(cancel.to_json(), live.ns.subject(ev.CancelRequested.SUBJECT))
        assert isinstance(live.run(live.conductor.cancel(d)), Ack)
    live.until(lambda: any(e["type"] == "request.cancelled" for e in live.heard[rid]))
    heard = live.heard[rid]
    assert heard[0]["type"] == "request.admitted"
    ends = {e["event_id"] for e in heard[1:]}
    assert {e["type"] for e in heard[1:]} == {"request.cancelled"} and len(ends) == 1, heard
    assert all(e["reason"] == "fuzz" for e in heard[1:])
    live.admits_a_good_request()


hostile_reports = st.fixed_dictionaries(
    {
        "instance": st.sampled_from(["fz-a", "fz-b", "fz-c"]),
        "role": st.sampled_from(["prefill", "decode"]),
        "node": st.sampled_from(["fz-a", "fz-b", "n"]),
        "seq": st.integers(1, 2**63),
        "at": st.floats(allow_nan=True, allow_infinity=True),
        "queued": st.integers(0, 2**40),
        "queued_tokens": st.integers(0, 2**40),
        "running": st.integers(0, 2**40),
        "context_tokens": st.integers(0, 2**62),
        "kv_capacity_tokens": st.none() | st.integers(0, 2**62),
    }
)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    reports=st.lists(hostile_reports, max_size=6),
    garbage=st.lists(st.binary(max_size=200) | json_values.map(json.dumps).map(str.encode),
                     max_size=6),
    kv=st.lists(st.fixed_dictionaries({
        "node_id": st.sampled_from(["fz-a", "p0", "n"]), "seq": st.integers(1, 2**40),
        "stored": st.lists(st.text(min_size=1, max_size=20), max_size=5),
        "removed": st.lists(st.text(min_size=1, max_size=20), max_size=5),
    }), max_size=4),
)  # fmt: skip
def test_the_conductors_feed_survives_hostile_reports_and_index_events(
    live: Live, reports: list[dict[str, Any]], garbage: list[bytes], kv: list[dict[str, Any]]
) -> None:
    ns, store = live.ns, p.Subjects(live.ns)

    async def send() -> None:
        for r in reports:
            body = json.dumps(r).encode()  # NaN / inf as JSON's non-standard literals
            await live.nc.publish(WorkSubjects(ns).load(r["instance"]), body)
        for g in garbage:
            await live.nc.publish(WorkSubjects(ns).load("fz-x"), g)
            await live.nc.publish(store.kv_events("p0"), g)
            await live.nc.publish(ns.of(ev.RequestPrefilled), g)
            await live.nc.publish(ns.of(ev.DecodeStarted), g)
        for k in kv:
            await live.nc.publish(store.kv_events(k["node_id"]), json.dumps(k).encode())
        await live.nc.flush()
        await asyncio.sleep(0.05)

    live.run(send())
    # A valid request is still decided: admitted (an odd view may send it to a fuzzed
    # instance) or rejected with a reason, or held back while the view says no decode pool
    # has KV room (a fuzzed capacity of 0): delayed, not dropped. Never dead-lettered.
    rid = fresh_id("good")
    outcome = live.decide(json.dumps(submitted_base(rid)).encode())
    if isinstance(outcome, Retry):
        assert "KV room" in str(outcome), outcome
        return
    assert isinstance(outcome, Ack), outcome
    (decision,) = live.decisions(rid)
    assert decision["type"] == "request.admitted" or decision.get("detail"), decision


# --- the same through the broker, into real processes ---------------------------------------------


@dataclass
class Procs:
    loop: asyncio.AbstractEventLoop
    nc: NATS
    settings: Settings
    workers: list[Worker]

    def run_with_fake_instances(self, check: Coroutine[Any, Any, None]) -> None:
        """Run `check` while a prefill and a decode instance that exist only in their load
        reports keep reporting (the Conductor admits to them; nobody serves the work)."""
        ns = ev.Namespace(self.settings.namespace)

        async def report() -> None:
            for seq in itertools.count(1):
                for iid, role in (("p0", "prefill"), ("d0", "decode")):
                    r = LoadReport(instance=iid, role=role, node=iid, seq=seq, at=time.time())
                    await self.nc.publish(WorkSubjects(ns).load(iid), r.to_json())
                await asyncio.sleep(0.2)

        async def run() -> None:
            reporting = asyncio.create_task(report())
            try:
                await check
            finally:
                reporting.cancel()

        self.loop.run_until_complete(run())


@pytest.fixture(scope="module")
def procs(
    nats_url: str, database_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Procs]:
    tmp = tmp_path_factory.mktemp("fuzz-procs")
    with psycopg.connect(database_url.replace("+psycopg", ""), autocommit=True) as conn:
        conn.execute(
            "TRUNCATE events, requests, kv_objects, instances, dead_letters RESTART IDENTITY"
        )
    s = Settings(
        _env_file=None,  # type: ignore[call-arg]
        nats_url=nats_url,
        database_url=database_url,
        namespace="fp" + uuid.uuid4().hex[:10],
        data_dir=tmp / "data",
    )
    env = {"MOONCAKE_BUS__MAX_EVENT_BYTES": str(MAX_EVENT_BYTES),
           "MOONCAKE_ENGINE__MODEL": "dummy", "MOONCAKE_BLOCK_TOKENS": "16",
           "MOONCAKE_CONDUCTOR__LIVENESS_TIMEOUT_S": "3600",
           "MOONCAKE_CONDUCTOR__CLIENT_RATE_PER_S": "0"}  # fmt: skip
    loop = asyncio.new_event_loop()
    nc = loop.run_until_complete(nats.connect(nats_url))
    loop.run_until_complete(ensure_streams(nc.jetstream(), s))
    workers = [Worker(r, s, tmp, env=env).start() for r in ("recorder", "conductor")]
    pr = Procs(loop, nc, s, workers)
    try:
        yield pr
    finally:
        codes = [w.stop() for w in workers]
        loop.run_until_complete(nc.drain())
        loop.close()
        for w in workers:
            assert "Traceback" not in w.log(), w.log()[-3000:]
        assert codes == [0, 0]


async def _rows(url: str, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    async with await psycopg.AsyncConnection.connect(url.replace("+psycopg", "")) as conn:
        return list(await (await conn.execute(sql, params)).fetchall())


def test_requests_that_reuse_an_event_id_are_each_decided(procs: Procs) -> None:
    """The finding the broker fuzz below made (a readable submission left undecided): two
    requests whose client reused one event id (here "NaN", one of the fuzzer's odd values)
    got the same decision id, and the broker dropped the second decision as a duplicate."""
    ns = ev.Namespace(procs.settings.namespace)
    url = procs.settings.database_url
    assert url
    rids = [fresh_id("reuse") for _ in range(3)]

    async def check() -> None:
        js = procs.nc.jetstream()
        for rid in rids:  # no Nats-Msg-Id: the broker keeps all three
            body = submitted_base(rid) | {"event_id": "NaN"}
            await js.publish(ns.of(ev.RequestSubmitted), json.dumps(body).encode())
        deadline = time.monotonic() + 30
        while True:
            rows = await _rows(
                url, "SELECT request_id, type FROM events WHERE request_id = ANY(%s) "
                "AND type IN ('request.admitted', 'request.rejected')", rids,
            )  # fmt: skip
            if len(rows) >= len(rids) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.25)
        assert sorted(r for r, _ in rows) == sorted(rids), rows
        # The record keeps the first submission of an event id only (its unique index), but
        # every request has its row, from its decision.
        status = await _rows(
            url, "SELECT request_id, status FROM requests WHERE request_id = ANY(%s)", rids
        )
        assert sorted(status) == sorted((rid, t.split(".")[1]) for rid, t in rows), status

    procs.run_with_fake_instances(check())


def test_submissions_with_nul_characters_are_decided_and_recorded(procs: Procs) -> None:
    """The finding of the broker fuzz's last CI failure, found by reading: Postgres cannot
    store U+0000 (in jsonb or text), so a submission holding one (a stop string), or the
    rejection that quotes one (an unknown field's name), could not be recorded: the
    recorder dead-lettered the event, and the request had no decision in the record."""
    ns = ev.Namespace(procs.settings.namespace)
    url = procs.settings.database_url
    assert url
    bodies = {
        fresh_id("nul"): {"params": {"max_tokens": 2, "stop": ["a\x00b"]}},  # admitted
        fresh_id("nul"): {"bogus\x00": 1},  # rejected, quoting the field's name
        fresh_id("nul"): {"prompt": "\x00", "token_ids": None},  # rejected: no tokenizer
    }

    async def check() -> None:
        js = procs.nc.jetstream()
        for rid, extra in bodies.items():
            body = submitted_base(rid) | extra
            await js.publish(ns.of(ev.RequestSubmitted), json.dumps(body).encode())
        deadline = time.monotonic() + 30
        while True:
            rows = await _rows(
                url, "SELECT request_id, type, payload::text FROM events WHERE "
                "request_id = ANY(%s) AND type <> 'request.cancelled' ORDER BY id", list(bodies),
            )  # fmt: skip
            decided = {r for r, t, _ in rows if t in ("request.admitted", "request.rejected")}
            if decided == set(bodies) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.25)
        letters = await _rows(url, "SELECT consumer, reason, detail FROM dead_letters")
        assert decided == set(bodies), (rows, letters)
        assert not [d for d in letters if d[1] == "unrecordable"], letters
        # The record keeps U+FFFD where the message had U+0000.
        first = next(iter(bodies))
        [stop] = [p for r, t, p in rows if t == "request.submitted" and r == first]
        assert json.loads(stop)["params"]["stop"] == ["a\ufffdb"], stop

    procs.run_with_fake_instances(check())


# 200 examples of 10 submissions each, derandomized (CI runs the same 2,000 every time; a
# seed finds new ones locally: MC_FUZZ_RANDOM=1). No shrinking: every example waits up to
# 60 s for the record, and a shrink runs dozens.
BROKER_FUZZ = 200
BROKER_BATCH = 10


@settings(
    max_examples=BROKER_FUZZ,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    phases=[Phase.explicit, Phase.generate],
    derandomize=not os.environ.get("MC_FUZZ_RANDOM"),
)
@given(data=st.data())
def test_fuzzed_batches_through_the_broker_are_all_accounted_for(
    procs: Procs, data: st.DataObject
) -> None:
    ns = ev.Namespace(procs.settings.namespace)
    samples = [data.draw(submissions(fresh_id("fb"))) for _ in range(BROKER_BATCH)]
    url = procs.settings.database_url
    assert url

    async def check() -> None:
        js = procs.nc.jetstream()
        # Every submitter that named a readable reply_to must hear its decision there.
        told = {
            s.request_id for s in samples
            if s.request_id is not None and ev.sniff_reply_to(s.data) == "fz.reply"
        }  # fmt: skip
        replied: set[str] = set()
        all_told = asyncio.Event()
        if not told:
            all_told.set()

        async def reply(msg: Msg) -> None:
            with contextlib.suppress(ValueError, AttributeError):
                replied.add(str(json.loads(msg.data).get("request_id")))
            if told <= replied:
                all_told.set()

        inbox = await procs.nc.subscribe(submitted_base("x")["reply_to"], cb=reply)
        acks = [await js.publish(ns.of(ev.RequestSubmitted), s.data) for s in samples]
        good = ev.RequestSubmitted(request_id=fresh_id("good"), token_ids=[1, 2, 3])
        await Publisher(procs.nc, js, ns).publish(good)
        readable = [s.request_id for s in samples if s.request_id is not None]
        # A request id can be drawn twice (the strategy's fixed bad ids): one row each.
        expected = {*readable, good.request_id}
        unreadable = {a.seq for a, s in zip(acks, samples, strict=True) if s.request_id is None}
        stream = acks[0].stream
        deadline = time.monotonic() + 60
        while True:
            decided = await _rows(
                url, "SELECT request_id, count(*) FROM events WHERE request_id = ANY(%s) "
                "AND type IN ('request.admitted', 'request.rejected') GROUP BY request_id",
                sorted(expected),
            )  # fmt: skip
            dead = await _rows(
                url, "SELECT stream_seq FROM dead_letters WHERE consumer = 'conductor' "
                "AND stream = %s AND stream_seq = ANY(%s)", stream, list(unreadable),
            )  # fmt: skip
            counts = dict(decided)
            if len(counts) == len(expected) and len(dead) == len(unreadable):
                break
            assert all(w.proc is not None and w.proc.poll() is None for w in procs.workers)
            if time.monotonic() > deadline:
                pytest.fail(await _broker_fuzz_report(procs, samples, acks, counts, dead))
            await asyncio.sleep(0.02)
        # One decision per submission: a request id submitted once has exactly one.
        once = [rid for rid in expected if readable.count(rid) <= 1]
        if not all(counts[rid] == 1 for rid in once):
            pytest.fail(await _broker_fuzz_report(procs, samples, acks, counts, dead))
        status = await _rows(
            url, "SELECT status FROM requests WHERE request_id = %s", good.request_id
        )
        assert status == [("admitted",)], status
        # Every rejection says why.
        undetailed = await _rows(
            url, "SELECT request_id, payload FROM events WHERE request_id = ANY(%s) AND "
            "type = 'request.rejected' AND coalesce(payload->>'detail', '') = ''", readable,
        )  # fmt: skip
        assert undetailed == [], undetailed
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(all_told.wait(), 10)
        await inbox.unsubscribe()
        assert told <= replied, sorted(told - replied)

    procs.run_with_fake_instances(check())


async def _broker_fuzz_report(
    procs: Procs,
    samples: list[Sample],
    acks: list[Any],
    counts: dict[str, int],
    dead: list[tuple[Any, ...]],
) -> str:
    """What the record holds of each submission the broker fuzz found wrong (undecided,
    decided twice, not dead-lettered), with the processes' logs: enough to tell why."""
    url = procs.settings.database_url
    assert url
    dead_seqs = {seq for (seq,) in dead}
    lines = []
    for ack, sample in zip(acks, samples, strict=True):
        rid = sample.request_id
        if (rid is None and ack.seq in dead_seqs) or (rid is not None and counts.get(rid) == 1):
            continue
        rows = await _rows(
            url, "SELECT type, event_id, stream_seq, payload->>'reason' FROM events "
            "WHERE request_id = %s ORDER BY id", rid or "",
        )  # fmt: skip
        letters = await _rows(
            url, "SELECT consumer, reason, detail FROM dead_letters WHERE stream = %s "
            "AND stream_seq = %s", ack.stream, ack.seq,
        )  # fmt: skip
        lines.append(f"seq {ack.seq} rid {rid}: events {rows}, dead letters {letters}, "
                     f"sent {sample.data[:300]!r}")  # fmt: skip
    logs = [f"--- {w.role} log (tail) ---\n{w.log()[-4000:]}" for w in procs.workers]
    return "\n".join(["submissions not accounted for:", *lines, *logs])


# --- store control --------------------------------------------------------------------------------

SECRET = b"fuzz-store-secret"
MASTER_BASES: dict[str, dict[str, Any]] = {
    "mount": {"node_id": "fz-node", "segments": [{"segment_id": "fz-node:0", "node_id": "fz-node",
              "tier": "dram", "size": 1 << 20, "endpoints": {}}], "objects": []},
    "heartbeat": {"node_id": "n1"},
    "put_start": {"items": [{"key": "k1", "size": 100, "replicas": 1, "pin": "none"}]},
    "put_end": {"keys": ["k1"]},
    "put_revoke": {"keys": ["k1"]},
    "lookup": {"keys": ["k1"]},
    "exists": {"keys": ["k1"]},
    "remove": {"keys": ["k1"], "force": True},
    "node_objects": {"node_id": "n1"},
}  # fmt: skip


@dataclass
class Store:
    loop: asyncio.AbstractEventLoop
    nc: NATS
    subjects: p.Subjects
    node: StoreNode
    client: StoreClient


@pytest.fixture(scope="module")
def store(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    loop = asyncio.new_event_loop()
    ns = ev.Namespace("fs" + uuid.uuid4().hex[:10])
    tmp = tmp_path_factory.mktemp("fuzz-store")

    async def setup() -> tuple[Store, StoreMaster]:
        from mooncake.config import StoreSettings

        nc = await nats.connect(nats_url)
        master = StoreMaster(nc, ns, new_state(StoreSettings(), seed=3), tick_s=0.05)
        await master.start()
        cfg = NodeConfig(node_id="n1", secret=SECRET, dram_bytes=4 << 20, ssd_dir=Path(tmp),
                         transports=("tcp",), heartbeat_s=0.1, request_timeout_s=2.0)  # fmt: skip
        node = StoreNode(nc, ns, cfg)
        await node.start()
        client = StoreClient(nc, ns, ClientConfig(SECRET, ("tcp",), request_timeout_s=2.0))
        return Store(loop, nc, p.Subjects(ns), node, client), master

    st_, master = loop.run_until_complete(setup())
    yield st_

    async def teardown() -> None:
        await st_.client.close()
        await st_.node.stop()
        await master.stop()
        await st_.nc.drain()

    loop.run_until_complete(teardown())
    loop.close()


@FUZZ
@given(op=st.sampled_from(sorted(MASTER_BASES)), data=st.data())
def test_mutated_master_requests_get_an_answer_and_the_master_goes_on(
    store: Store, op: str, data: st.DataObject
) -> None:
    body = data.draw(mutated(MASTER_BASES[op]))

    async def one() -> None:
        resp = await store.nc.request(store.subjects.master(op), json.dumps(body).encode(), 2)
        assert isinstance(json.loads(resp.data), dict), resp.data
        alive = await store.nc.request(store.subjects.master("exists"), b'{"keys": ["z"]}', 2)
        assert json.loads(alive.data) == {"results": [False]}

    store.loop.run_until_complete(one())


def _region(seg: str) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({
        "segment_id": st.sampled_from([seg, "n1:missing", "x"]), "node_id": st.just("n1"),
        "tier": st.sampled_from(["dram", "ssd"]),
        "offset": st.sampled_from([0, 1, 4095, (4 << 20) - 1, 4 << 20, 1 << 49]),
        "size": st.sampled_from([0, 1, 4096, 4 << 20, (4 << 20) + 1, 1 << 49]),
        "state": st.sampled_from(["complete", "pending"]),
    })  # fmt: skip


@FUZZ
@given(data=st.data())
def test_a_nodes_move_and_changes_subjects_survive_fuzz(store: Store, data: st.DataObject) -> None:
    seg = next(iter(store.node.segment_infos())).segment_id
    move = data.draw(
        st.one_of(
            st.fixed_dictionaries({"key": st.text(min_size=1, max_size=10),
                                   "src": _region(seg), "dst": _region(seg)}),
            json_values,
        ).map(json.dumps).map(str.encode) | st.binary(max_size=200)
    )  # fmt: skip
    changes = data.draw(
        st.one_of(
            st.builds(lambda s, u: {"seq": s, "updates": u}, st.integers(-1, 2**40),
                      st.lists(st.fixed_dictionaries({"key": st.text(max_size=10),
                                                      "held": st.just([])}), max_size=3)),
            json_values,
        ).map(json.dumps).map(str.encode) | st.binary(max_size=200)
    )  # fmt: skip

    async def one() -> None:
        resp = await store.nc.request(store.subjects.node("n1", "move"), move, 2)
        p.OkReply.model_validate_json(resp.data)  # always an answer in the reply's schema
        await store.nc.publish(store.subjects.node("n1", "changes"), changes)
        await store.nc.flush()

    store.loop.run_until_complete(one())


def test_the_store_still_puts_and_gets_after_the_fuzz(store: Store) -> None:
    async def one() -> None:
        blob = os.urandom(10_000)
        key = fresh_id("after")
        for _ in range(50):  # the node may be re-syncing after a fuzzed change sequence
            if await store.client.put(key, blob) is None:
                break
            await asyncio.sleep(0.1)
        assert await store.client.get(key) == blob

    store.loop.run_until_complete(one())

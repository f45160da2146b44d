"""The live Conductor against a real NATS, with fake instances: the test publishes their load
reports and KV index events itself and plays their work consumers (no engine, no store).

Covers: admission to the instance that holds the prompt's prefix with a PrefillWork on its
subject; rejection under `early` and `predicted` when instances are overloaded; start-up
retries and `no_instance`; re-dispatch of a dead instance's unacked work and the one
RequestFailed after `max_attempts`; exactly one RequestCancelled for a cancel.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from mooncake import events as ev
from mooncake.bus import terminal
from mooncake.bus.connection import ensure_streams
from mooncake.bus.consume import PullConsumer
from mooncake.bus.publish import Publisher
from mooncake.client import SystemDown, check_admitting
from mooncake.config import BusSettings, ConductorSettings, DummyModel, EngineSettings, Settings
from mooncake.hashing import request_keys
from mooncake.serving import conductor_dispatch as dispatch
from mooncake.serving.conductor_reaper import Role, work_consumer
from mooncake.stack import other_system
from mooncake.store import protocol as sp
from mooncake.work import (
    DecodeWork,
    LoadReport,
    PrefillWork,
    TokenChunk,
    WorkSubjects,
    completed_event_id,
)
from workers import conductor as conductor_worker
from workers.runtime import WorkerContext

BT = 16  # block tokens: small prompts, several whole blocks


def live_settings(nats_url: str, namespace: str, **over: Any) -> Settings:
    conductor = ConductorSettings(
        **{
            "load_report_interval_s": 0.1,
            "liveness_timeout_s": 0.8,
            "max_attempts": 2,
            "no_instance_wait_s": 1.0,
            **over.pop("conductor", {}),
        }
    )
    return Settings(
        nats_url=nats_url,
        namespace=namespace,
        block_tokens=BT,
        engine=EngineSettings(model="dummy"),
        bus=BusSettings(ack_wait_s=1.0),
        conductor=conductor,
        **over,
    )


@dataclass
class Fake:
    role: str
    node: str
    running: int = 0
    context_tokens: int = 0


@dataclass
class Cluster:
    """The test's side of the bus: fake instances, their KV, the events it heard."""

    nc: NATS
    js: JetStreamContext
    settings: Settings
    instances: dict[str, Fake] = field(default_factory=dict)
    kv: dict[str, list[str]] = field(default_factory=dict)  # node -> keys (seq 1)
    events: list[dict[str, Any]] = field(default_factory=list)
    replies: dict[str, list[bytes]] = field(default_factory=dict)
    seq: int = 0

    @property
    def ns(self) -> ev.Namespace:
        return ev.Namespace(self.settings.namespace)

    async def tick(self) -> None:
        self.seq += 1
        subjects = WorkSubjects(self.ns)
        for iid, f in list(self.instances.items()):
            r = LoadReport(
                instance=iid, role=f.role, node=f.node, seq=self.seq, at=time.time(),
                running=f.running, context_tokens=f.context_tokens,
            )  # fmt: skip
            await self.nc.publish(subjects.load(iid), r.to_json())
        for node, keys in self.kv.items():
            batch = sp.KvEvents(node_id=node, seq=1, stored=keys)  # re-sent: a duplicate
            await self.nc.publish(
                sp.Subjects(self.ns).kv_events(node), batch.model_dump_json().encode()
            )

    def of(self, type_: str, rid: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == type_ and e.get("request_id") == rid]

    async def outcome(self, rid: str, wait_s: float = 10.0) -> dict[str, Any]:
        async def found() -> dict[str, Any] | None:
            for t in ("request.admitted", "request.rejected"):
                if got := self.of(t, rid):
                    return got[0]
            return None

        got: dict[str, Any] = await until(found, wait_s, f"an admission outcome for {rid}")
        return got

    def request(self, rid: str, **kw: Any) -> ev.RequestSubmitted:
        return ev.RequestSubmitted(request_id=rid, reply_to=f"_INBOX.{self.ns.prefix}.{rid}", **kw)

    async def submit(self, rid: str, **kw: Any) -> ev.RequestSubmitted:
        return await self.send(self.request(rid, **kw))

    async def send(self, req: ev.RequestSubmitted) -> ev.RequestSubmitted:
        self.replies[req.request_id] = []
        await self.nc.subscribe(req.reply_to or "", cb=self._reply(req.request_id))
        await Publisher(self.nc, self.js, self.ns).publish(req)
        return req

    def _reply(self, rid: str) -> Callable[[Msg], Awaitable[None]]:
        async def cb(msg: Msg) -> None:
            self.replies[rid].append(msg.data)

        return cb

    async def bind_work(self, role: Role, instance: str) -> JetStreamContext.PullSubscription:
        """The work consumer a real worker would make for itself at start."""
        bus = self.settings.bus
        pc = PullConsumer(self.nc, self.js, work_consumer(role, instance), bus, self.ns, batch=1)
        await pc.ensure()
        spec = pc.spec
        return await self.js.pull_subscribe_bind(durable=spec.durable, stream=spec.stream)


async def until(
    probe: Callable[[], Awaitable[Any]], wait_s: float, what: str, every: float = 0.05
) -> Any:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if (got := await probe()) is not None and got is not False:
            return got
        await asyncio.sleep(every)
    pytest.fail(f"timed out waiting for {what}")


@asynccontextmanager
async def live(s: Settings) -> AsyncIterator[tuple[Cluster, conductor_worker.Conductor]]:
    """A Conductor in this process (the worker's own start/serve) and the test's cluster."""
    nc = await nats.connect(s.nats_url)
    js = nc.jetstream()
    await ensure_streams(js, s)
    ns = ev.Namespace(s.namespace)
    cluster = Cluster(nc, js, s)

    async def heard(msg: Msg) -> None:
        cluster.events.append(json.loads(msg.data))

    await nc.subscribe(ns.subject("mc.req.>"), cb=heard)
    publisher = Publisher(nc, js, ns)
    ctx = WorkerContext(s, "conductor", "c0", nc, js, publisher, ns, asyncio.Event(), None)
    conductor = await conductor_worker.start_conductor(ctx)
    served = asyncio.create_task(conductor_worker.serve(ctx, conductor))

    async def beat() -> None:
        while True:
            await cluster.tick()  # a failure here fails the test (awaited below)
            await asyncio.sleep(s.conductor.load_report_interval_s)

    beating = asyncio.create_task(beat())
    try:
        yield cluster, conductor
    finally:
        beating.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await beating
        ctx.stop.set()
        await asyncio.wait_for(served, 15)
        await nc.drain()


async def known(conductor: conductor_worker.Conductor, *instances: str) -> None:
    view = conductor.view

    async def probe() -> bool:
        return all(i in view.prefill or i in view.decode for i in instances)

    await until(probe, 5, f"the Conductor to know {instances}")


def tokens(n: int, salt: int = 0) -> list[int]:
    return [(7 * i + salt) % 1000 + 1 for i in range(n)]


def keys_of(s: Settings, toks: list[int]) -> list[str]:
    return request_keys(toks, s.block_tokens, seed=s.hash_seed, model_id=s.model_id)


async def test_admits_to_the_prefix_holder_and_dispatches_its_work(
    nats_url: str, namespace: str
) -> None:
    s = live_settings(nats_url, namespace)
    toks = tokens(4 * BT + 6)
    async with live(s) as (cl, conductor):
        cl.instances |= {"p1": Fake("prefill", "n1"), "p2": Fake("prefill", "n2")}
        cl.instances["d1"] = Fake("decode", "n3")
        cl.kv["n2"] = keys_of(s, toks)
        await known(conductor, "p1", "p2", "d1")
        await until(lambda: _held(conductor, "n2", cl.kv["n2"]), 5, "n2's blocks in the index")
        p2_work = await cl.bind_work("prefill", "p2")

        req = await cl.submit("r-prefix", token_ids=toks, deadline_s=60.0)
        out = await cl.outcome("r-prefix")
        assert out["type"] == "request.admitted", out
        assert (out["prefill_instance"], out["decode_instance"]) == ("p2", "d1")
        assert out["prompt_tokens"] == len(toks) and out["cached_prefix_tokens"] == 4 * BT
        assert out["predicted_ttft_s"] > 0 and out["predicted_tbt_s"] > 0
        inputs = out["inputs"]
        assert inputs["local_prefix_blocks"] == 4 and {c[0] for c in inputs["candidates"]} == {
            "p1",
            "p2",
        }
        [msg] = await p2_work.fetch(1, timeout=5)
        work = PrefillWork.model_validate_json(msg.data)
        assert (work.attempt, work.cached_blocks, work.local_blocks) == (1, 4, 4)
        assert work.token_ids == toks and work.decode_instance == "d1"
        assert work.timing.submitted_at == pytest.approx(req.occurred_at.timestamp())
        assert work.timing.deadline_at == pytest.approx(work.timing.submitted_at + 60.0)
        assert msg.headers and msg.headers["Nats-Msg-Id"] == ev.derived_event_id(
            f"{req.request_id}/{req.event_id}", "prefill-work-1"
        )
        assert (
            work.admitted_event_id
            == out["event_id"]
            == ev.derived_event_id(f"{req.request_id}/{req.event_id}", "decision")
        )
        await msg.ack()
        # The decision reached the client too.
        assert json.loads(cl.replies["r-prefix"][0])["type"] == "request.admitted"

        # A text prompt with the dummy model (no tokenizer): invalid, with a clear detail.
        await cl.submit("r-text", prompt="hello")
        bad = await cl.outcome("r-text")
        assert (bad["type"], bad["reason"]) == ("request.rejected", "invalid_request")
        assert "token_ids" in bad["detail"]


async def test_a_flooding_tenant_past_its_share_is_rejected_and_the_others_admitted(
    nats_url: str, namespace: str
) -> None:
    """Shares made to bind at any load (contention 0): the prefill work queued on the fake
    instance (it takes none) piles up; the tenant holding most of it is refused with
    `tenant_quota`, the other is admitted, and each decision records its tenant."""
    conductor_over = {"tenant_contention": 0.0, "online_cost": False}
    s = live_settings(nats_url, namespace, admission_policy="early", conductor=conductor_over)
    async with live(s) as (cl, conductor):
        cl.instances |= {"p1": Fake("prefill", "n1"), "d1": Fake("decode", "n2")}
        await known(conductor, "p1", "d1")
        order = [("f1", "flood"), ("f2", "flood"), ("c1", "calm"), ("f3", "flood"),
                 ("c2", "calm")]  # fmt: skip
        outs = {}
        for i, (rid, tenant) in enumerate(order):
            await cl.submit(rid, token_ids=tokens(40, salt=i), tenant=tenant)
            outs[rid] = await cl.outcome(rid)  # one after the other: the order is the test
        kinds = {rid: (o["type"], o.get("reason")) for rid, o in outs.items()}
        admitted = ("request.admitted", None)
        assert kinds == {
            "f1": admitted, "f2": admitted,  # alone: never over its share
            "c1": admitted,  # holds nothing
            "f3": ("request.rejected", "tenant_quota"),  # 2 of 3 queued prefills are flood's
            "c2": admitted,  # 1 of 3: within its half
        }, kinds  # fmt: skip
        assert outs["f3"]["detail"].startswith("tenant flood holds 67% of the prefill work")
        assert {rid: o["inputs"]["tenant"] for rid, o in outs.items()} == dict(order)


async def _held(conductor: conductor_worker.Conductor, node: str, keys: list[str]) -> bool:
    return conductor.view.blocks.match(keys).local_blocks(node) == len(keys)


async def test_early_rejects_on_an_overloaded_decode_instance(
    nats_url: str, namespace: str
) -> None:
    # Reference cost model (LLaMA3-70B on 8xA800): 5 M tokens of context put a decode step
    # near 0.19 s, over the 0.1 s TBT limit.
    s = live_settings(nats_url, namespace, admission_policy="early")
    async with live(s) as (cl, conductor):
        cl.instances |= {"p1": Fake("prefill", "n1")}
        cl.instances["d1"] = Fake("decode", "n2", running=40, context_tokens=5_000_000)
        await known(conductor, "p1", "d1")
        await until(lambda: _batch(conductor, "d1", 40), 5, "d1's reported batch")
        await cl.submit("r-over", token_ids=tokens(40))
        out = await cl.outcome("r-over")
        assert (out["type"], out["reason"], out["policy"]) == (
            "request.rejected",
            "tbt_slo",
            "early",
        )
        assert out["predicted_tbt_s"] > 0.1 and out["inputs"]["decode_load"] > 1.0
        tbt_ms = round(out["predicted_tbt_s"] * 1000)
        assert out["detail"] == f"predicted TBT {tbt_ms} ms on d1 is over the SLO of 100 ms"


async def _batch(conductor: conductor_worker.Conductor, iid: str, n: int) -> bool:
    d = conductor.view.decode.get(iid)
    return d is not None and d.batch == n


def write_profile(path: Path) -> Path:
    """A profiled engine where a prefill costs 20 ms per token and a decode step 40 ms per
    sequence in the batch: the third concurrent request breaks a 100 ms TBT."""
    prefill = [
        {"prompt_tokens": n, "cached_tokens": 0, "seconds": 0.02 * n} for n in (8, 16, 32, 64)
    ]
    decode = [
        {"batch": b, "context_tokens": c, "seconds": 0.04 * b}
        for b in (1, 2, 4, 8)
        for c in (0, 1000, 5000)
    ]
    path.write_text(
        json.dumps({"schema": "mooncake.profile/1", "prefill": prefill, "decode": decode})
    )
    return path


async def test_predicted_rejects_when_decode_will_be_overloaded(
    nats_url: str, namespace: str, tmp_path: Path
) -> None:
    profile = write_profile(tmp_path / "profile.json")
    s = live_settings(
        nats_url, namespace, admission_policy="predicted", conductor={"cost_profile": profile}
    )
    async with live(s) as (cl, conductor):
        cl.instances |= {"p1": Fake("prefill", "n1"), "d1": Fake("decode", "n2")}
        await known(conductor, "p1", "d1")
        got = []
        for i in range(3):
            await cl.submit(f"r-pred-{i}", token_ids=tokens(20, salt=i))
            got.append(await cl.outcome(f"r-pred-{i}"))
        assert [o["type"] for o in got] == ["request.admitted"] * 2 + ["request.rejected"]
        assert got[2]["reason"] == "decode_overloaded" and got[2]["policy"] == "predicted"
        assert (
            got[2]["detail"].startswith("decode load ") and "predicted policy" in got[2]["detail"]
        )
        # Judged at the time its prefill would finish: behind the two queued prefills.
        assert got[2]["predicted_ttft_s"] == pytest.approx(1.2, rel=0.05)
        assert got[2]["inputs"]["extra"]["tbt_at:d1"] == pytest.approx(0.12, rel=0.05)


async def test_no_instance_retries_then_rejects_and_a_late_instance_admits(
    nats_url: str, namespace: str
) -> None:
    s = live_settings(nats_url, namespace)
    async with live(s) as (cl, _conductor):
        started = time.monotonic()
        await cl.submit("r-none", token_ids=tokens(20))
        out = await cl.outcome("r-none")
        assert (out["type"], out["reason"]) == ("request.rejected", "no_instance")
        assert out["detail"] == (
            "no live prefill instance (live: 0 prefill, 0 decode; waited 1 s for one)"
        )
        assert time.monotonic() - started >= 0.8  # it waited for instances first

        await cl.submit("r-late", token_ids=tokens(20))
        await asyncio.sleep(0.2)
        cl.instances |= {"p1": Fake("prefill", "n1"), "d1": Fake("decode", "n2")}
        late = await cl.outcome("r-late")
        assert late["type"] == "request.admitted" and late["prefill_instance"] == "p1"


async def test_dead_prefill_work_is_redispatched_then_fails_once(
    nats_url: str, namespace: str
) -> None:
    s = live_settings(nats_url, namespace)  # max_attempts=2
    toks = tokens(3 * BT)
    async with live(s) as (cl, conductor):
        cl.instances |= {"p1": Fake("prefill", "n1"), "p2": Fake("prefill", "n2")}
        cl.instances["d1"] = Fake("decode", "n3")
        cl.kv["n1"] = keys_of(s, toks)
        await known(conductor, "p1", "p2", "d1")
        await until(lambda: _held(conductor, "n1", cl.kv["n1"]), 5, "n1's blocks in the index")
        p1_work, p2_work = await cl.bind_work("prefill", "p1"), await cl.bind_work("prefill", "p2")

        await cl.submit("r-dead", token_ids=toks)
        assert (await cl.outcome("r-dead"))["prefill_instance"] == "p1"
        [held] = await p1_work.fetch(1, timeout=5)  # p1 takes it ... and dies holding it
        assert PrefillWork.model_validate_json(held.data).attempt == 1
        await p1_work.unsubscribe()
        del cl.instances["p1"]

        [again] = await p2_work.fetch(1, timeout=15)
        work = PrefillWork.model_validate_json(again.data)
        assert (work.attempt, work.prefill_instance, work.decode_instance) == (2, "p2", "d1")
        await p2_work.unsubscribe()
        del cl.instances["p2"]  # p2 dies holding it too: max_attempts (2) is spent

        failed = await until(
            lambda: _some(cl.of("request.failed", "r-dead")), 15, "the request to fail"
        )
        await asyncio.sleep(1.5)  # nothing more comes
        assert len(cl.of("request.failed", "r-dead")) == 1
        assert (failed[0]["reason"], failed[0]["stage"]) == ("retries_exhausted", "prefill")
        chunks = [json.loads(b) for b in cl.replies["r-dead"][1:]]
        final = TokenChunk.model_validate(chunks[-1])
        assert final.done and final.finish_reason == "failed"
        assert await terminal.ended(conductor.ender.kv, "r-dead") == "failed"


async def test_a_lone_instance_back_from_the_dead_gets_its_work_with_deliveries_to_spare(
    nats_url: str, namespace: str
) -> None:
    """A lone prefill dies holding work; no other can take it. The reaper keeps the work
    without spending deliveries (a nak a second spent max_deliver in five, and the work
    failed as exhausted when its owner came back); the owner, back, gets it at once, and
    dying again holding it starts a new wait rather than failing it on the spot."""
    wait_s = 5.0
    s = live_settings(nats_url, namespace, conductor={"no_instance_wait_s": wait_s})
    s = s.model_copy(update={"bus": s.bus.model_copy(update={"max_deliver": 4})})
    max_deliver = s.bus.max_deliver
    async with live(s) as (cl, conductor):
        cl.instances |= {"p1": Fake("prefill", "n1"), "d1": Fake("decode", "n2")}
        await known(conductor, "p1", "d1")
        p1_work = await cl.bind_work("prefill", "p1")
        await cl.submit("r-lone", token_ids=tokens(3 * BT))
        assert (await cl.outcome("r-lone"))["prefill_instance"] == "p1"
        [held] = await p1_work.fetch(1, timeout=5)  # p1 takes it ... and dies holding it
        assert held.metadata.num_delivered == 1
        await p1_work.unsubscribe()
        del cl.instances["p1"]

        async def reaped() -> bool:
            return "p1" in conductor.reaper._tasks

        await until(reaped, 5, "the reaper to take p1's work")
        await asyncio.sleep(wait_s - 1.5)  # a nak a second: past max_deliver by now
        assert not cl.of("request.failed", "r-lone")
        cl.instances["p1"] = Fake("prefill", "n1")  # back
        p1_work = await cl.bind_work("prefill", "p1")
        [back] = await p1_work.fetch(1, timeout=5)
        # Its own delivery, the reaper's, and this one: deliveries left to do the work.
        assert back.metadata.num_delivered <= 3 < max_deliver
        assert PrefillWork.model_validate_json(back.data).attempt == 1  # not re-dispatched
        await p1_work.unsubscribe()
        del cl.instances["p1"]  # dies holding it again

        died_again = time.monotonic()
        failed = await until(
            lambda: _some(cl.of("request.failed", "r-lone")), 15, "the request to fail"
        )
        # A new wait from this death (a stale start from the first would fail it at once).
        assert time.monotonic() - died_again >= wait_s
        assert (failed[0]["reason"], failed[0]["stage"]) == ("no_instance", "prefill")
        await asyncio.sleep(1.0)
        assert len(cl.of("request.failed", "r-lone")) == 1


async def _some(items: list[Any]) -> list[Any] | None:
    return items or None


async def test_cancel_ends_a_request_exactly_once(nats_url: str, namespace: str) -> None:
    s = live_settings(nats_url, namespace)
    async with live(s) as (cl, conductor):
        cl.instances |= {"p1": Fake("prefill", "n1"), "d1": Fake("decode", "n2")}
        await known(conductor, "p1", "d1")
        await cl.submit("r-cancel", token_ids=tokens(20))
        assert (await cl.outcome("r-cancel"))["type"] == "request.admitted"
        pub = Publisher(cl.nc, cl.js, cl.ns)
        for _ in range(2):  # a second cancel (another event) changes nothing
            await pub.publish(ev.CancelRequested(request_id="r-cancel", reason="client"))
        got = await until(
            lambda: _some(cl.of("request.cancelled", "r-cancel")), 10, "the cancellation"
        )
        await asyncio.sleep(1.0)
        assert len(cl.of("request.cancelled", "r-cancel")) == 1
        assert got[0]["stage"] == "prefill"
        final = TokenChunk.model_validate_json(cl.replies["r-cancel"][-1])
        assert final.done and final.finish_reason == "cancelled"
        assert "r-cancel" not in conductor.view.inflight


async def test_a_decision_the_broker_already_holds_stands(nats_url: str, namespace: str) -> None:
    """A submission decided before (its decision reached the broker, its ack did not reach
    the Conductor, and the submission came again; or it was redelivered while still being
    handled) may be decided differently the second time. The decision has one id whichever
    it is, so the broker keeps the first; the Conductor acts on that one: no work for an
    admission it did not keep, the kept admission's work to the instances it names, and the
    client told the kept decision."""
    s = live_settings(nats_url, namespace)
    toks = tokens(3 * BT)
    async with live(s) as (cl, conductor):
        cl.instances |= {"p1": Fake("prefill", "n1"), "p2": Fake("prefill", "n2")}
        cl.instances["d1"] = Fake("decode", "n3")
        cl.kv["n1"] = keys_of(s, toks)  # the Conductor would pick p1, the prefix holder
        await known(conductor, "p1", "p2", "d1")
        await until(lambda: _held(conductor, "n1", cl.kv["n1"]), 5, "n1's blocks in the index")
        work = {p: await cl.bind_work("prefill", p) for p in ("p1", "p2")}
        pub = Publisher(cl.nc, cl.js, cl.ns)

        # The broker holds a rejection: it stands, and no work goes out.
        req = cl.request("r-kept-reject", token_ids=toks)
        kept = ev.RequestRejected(
            event_id=dispatch.decision_event_id(req), request_id=req.request_id,
            reason=ev.RejectReason.DECODE_OVERLOADED, stage="admission",
        )  # fmt: skip
        await pub.publish(kept)
        await cl.send(req)
        await until(lambda: _some(cl.replies[req.request_id]), 10, "the reply")
        [told] = [json.loads(b) for b in cl.replies[req.request_id]]
        assert (told["type"], told["event_id"]) == ("request.rejected", kept.event_id), told
        for sub in work.values():
            with pytest.raises(nats.errors.TimeoutError):
                await sub.fetch(1, timeout=0.5)
        assert req.request_id not in conductor.view.inflight
        assert conductor.known.get(req.request_id) is None

        # The broker holds an admission to p2: its work goes to p2, not to p1.
        req = cl.request("r-kept-admit", token_ids=toks)
        stored = ev.RequestAdmitted(
            event_id=dispatch.decision_event_id(req), request_id=req.request_id, policy="kvcache",
            prefill_instance="p2", decode_instance="d1", prompt_tokens=len(toks),
            inputs={"local_prefix_blocks": 0},
        )  # fmt: skip
        await pub.publish(stored)
        await cl.send(req)
        [msg] = await work["p2"].fetch(1, timeout=10)
        got = PrefillWork.model_validate_json(msg.data)
        assert (got.request_id, got.admitted_event_id) == (req.request_id, stored.event_id)
        assert (got.prefill_instance, got.decode_instance, got.cached_blocks) == ("p2", "d1", 0)
        assert got.token_ids == toks
        await msg.ack()
        with pytest.raises(nats.errors.TimeoutError):
            await work["p1"].fetch(1, timeout=0.5)
        await until(lambda: _some(cl.replies[req.request_id]), 10, "the reply")
        told = json.loads(cl.replies[req.request_id][0])
        assert (told["type"], told["prefill_instance"]) == ("request.admitted", "p2"), told
        assert conductor.known.get(req.request_id) is not None
        for sub in work.values():
            await sub.unsubscribe()


async def test_work_handed_to_a_dead_decode_after_its_reaping_still_reaches_a_live_one(
    nats_url: str, namespace: str
) -> None:
    """Decode d1 dies while a request bound to it is still queued at a live prefill. The
    prefill hands the decode work to d1's subject only later (a long queue), after d1's
    consumer has been drained and the reaper's linger (2 ack_waits + liveness) is over: the
    work must still reach d2, not sit in d1's consumer until the request times out."""
    s = live_settings(nats_url, namespace)  # linger: 2 x 1.0 + 0.8 s
    toks = tokens(2 * BT)
    async with live(s) as (cl, conductor):
        cl.instances |= {"p1": Fake("prefill", "n1"), "d1": Fake("decode", "n2")}
        await known(conductor, "p1", "d1")
        p1_work = await cl.bind_work("prefill", "p1")
        await cl.submit("r-late", token_ids=toks, deadline_s=60.0)
        assert (await cl.outcome("r-late"))["decode_instance"] == "d1"
        [msg] = await p1_work.fetch(1, timeout=5)
        work = PrefillWork.model_validate_json(msg.data)
        d1_work = await cl.bind_work("decode", "d1")  # d1 had made its consumer; then it dies
        await d1_work.unsubscribe()
        del cl.instances["d1"]
        cl.instances["d2"] = Fake("decode", "n3")
        await known(conductor, "d2")
        await until(lambda: _true("d1" not in conductor.view.decode), 5, "d1 declared dead")
        await asyncio.sleep(2 * s.bus.ack_wait_s + s.conductor.liveness_timeout_s + 2.0)

        # p1 finishes the prefill now and hands over to the decode instance it was given.
        decode = DecodeWork(
            request_id=work.request_id, token_ids=work.token_ids, first_token_id=5,
            prefill_instance="p1", decode_instance=work.decode_instance, timing=work.timing,
            first_token_at=time.time(), admitted_event_id=work.admitted_event_id,
        )  # fmt: skip
        await cl.js.publish(WorkSubjects(cl.ns).decode("d1"), decode.to_json())
        await msg.ack()
        d2_work = await cl.bind_work("decode", "d2")
        [moved] = await d2_work.fetch(1, timeout=10)
        got = DecodeWork.model_validate_json(moved.data)
        assert (got.request_id, got.decode_instance, got.attempt) == ("r-late", "d2", 2)
        await moved.ack()
        await d2_work.unsubscribe()


async def _true(v: bool) -> bool:
    return v


async def test_what_cannot_fit_the_context_is_rejected_before_any_work(
    nats_url: str, namespace: str
) -> None:
    """Against the model's context (64 here): a prompt that fills it is `prompt_too_long`, a
    max_tokens asked for past it `max_tokens_too_large` (each with the numbers, told to the
    client, no work sent); a default max_tokens is cut to the room the prompt leaves."""
    s = live_settings(nats_url, namespace)
    s = s.model_copy(update={"engine": EngineSettings(model="dummy", dummy=DummyModel(context=64))})
    async with live(s) as (cl, conductor):
        cl.instances |= {"p1": Fake("prefill", "n1"), "d1": Fake("decode", "n2")}
        await known(conductor, "p1", "d1")
        p1_work = await cl.bind_work("prefill", "p1")

        await cl.submit("r-long", token_ids=tokens(64))
        await cl.submit("r-many", token_ids=tokens(40), params=ev.SamplingParams(max_tokens=25))
        long_, many = await cl.outcome("r-long"), await cl.outcome("r-many")
        assert (long_["type"], long_["reason"]) == ("request.rejected", "prompt_too_long")
        assert "at most 63 tokens" in long_["detail"]
        assert (many["type"], many["reason"]) == ("request.rejected", "max_tokens_too_large")
        assert "at most 24 tokens" in many["detail"]
        for rid, reason in (("r-long", "prompt_too_long"), ("r-many", "max_tokens_too_large")):
            await until(lambda r=rid: _some(cl.replies[r]), 10, f"the reply to {rid}")
            told = json.loads(cl.replies[rid][0])
            assert (told["type"], told["reason"]) == ("request.rejected", reason)

        # No max_tokens in the submission: the default (128) is cut to the 24 that fit.
        raw = {"request_id": "r-room", "token_ids": tokens(40), "reply_to": "_INBOX.r-room"}
        await cl.nc.subscribe("_INBOX.r-room", cb=cl._reply("r-room"))
        cl.replies["r-room"] = []
        await cl.js.publish(cl.ns.subject(ev.RequestSubmitted.SUBJECT), json.dumps(
            {"type": "request.submitted", "event_id": "e-room", **raw}).encode())  # fmt: skip
        room = await cl.outcome("r-room")
        assert (room["type"], room["inputs"]["max_tokens"]) == ("request.admitted", 24)
        [msg] = await p1_work.fetch(1, timeout=5)
        work = PrefillWork.model_validate_json(msg.data)
        assert (work.request_id, work.params.max_tokens) == ("r-room", 24)
        await msg.ack()
        await p1_work.unsubscribe()


async def test_a_rejection_claims_the_end_and_a_cancel_that_came_first_wins(
    nats_url: str, namespace: str
) -> None:
    """A rejection ends its request through the terminal claim, as every end does: the slot
    says `rejected` afterwards, and a request whose end was claimed first (a cancel handled
    by another Conductor, or here while this one's admission step ran) gets no rejection:
    one terminal event, not two. An ingress rejection claims too."""
    s = live_settings(nats_url, namespace)
    s = s.model_copy(update={"engine": EngineSettings(model="dummy", dummy=DummyModel(context=64))})
    async with live(s) as (cl, conductor):
        conductor._started -= 60.0  # past the start-up check that reads the slot at intake
        kv = conductor.ender.kv
        cl.instances |= {"p1": Fake("prefill", "n1"), "d1": Fake("decode", "n2")}
        await known(conductor, "p1", "d1")

        await cl.submit("r-too-long", token_ids=tokens(64))
        assert (await cl.outcome("r-too-long"))["reason"] == "prompt_too_long"
        assert await terminal.ended(kv, "r-too-long") == "rejected"

        assert await terminal.claim(kv, "r-raced", "cancelled", "cancel-1")
        await cl.submit("r-raced", token_ids=tokens(64))
        await cl.submit("r-after", token_ids=tokens(64))  # in order behind it
        await cl.outcome("r-after")
        assert cl.of("request.rejected", "r-raced") == [] and cl.replies["r-raced"] == []
        assert await terminal.ended(kv, "r-raced") == "cancelled"

        # An attempt that claimed a rejection and died before publishing it: this one
        # publishes it (the claim is its own), not drops the request as ended.
        half = cl.request("r-half-rejected", token_ids=tokens(64))
        decision = dispatch.decision_event_id(half)
        assert await terminal.claim(kv, "r-half-rejected", "rejected", decision)
        conductor._started += 60.0  # the start-up check reads the slot, as after a restart
        await cl.send(half)
        got = await cl.outcome("r-half-rejected")
        assert (got["type"], got["event_id"]) == ("request.rejected", decision)
        conductor._started -= 60.0

        bad = cl.request("r-reply-to-us", token_ids=tokens(4))
        bad = bad.model_copy(update={"reply_to": cl.ns.subject("mc.req.x")})
        await Publisher(cl.nc, cl.js, cl.ns).publish(bad)
        assert (await cl.outcome("r-reply-to-us"))["stage"] == "ingress"
        assert await terminal.ended(kv, "r-reply-to-us") == "rejected"


async def test_submit_against_a_stopped_system_fails_fast_and_sends_nothing(
    nats_url: str, namespace: str
) -> None:
    """`mooncake submit` / `replay` check that a Conductor takes submissions before they
    publish: a request sent to a stopped system would sit in MC_REQ for a later `up` while
    its client heard nothing."""
    s = live_settings(nats_url, namespace)
    ns = ev.Namespace(s.namespace)
    nc = await nats.connect(nats_url)
    try:
        with pytest.raises(SystemDown, match="no Conductor has run"):
            await check_admitting(nc, ns)
        async with live(s):
            await check_admitting(nc, ns, within_s=5)  # an idle Conductor: a pull is waiting
        with pytest.raises(SystemDown, match="is `mooncake up` running"):
            # Gives up after its own 3 s of checking (a hang, not a slow run, fails here).
            await asyncio.wait_for(check_admitting(nc, ns), 60)
        stream = ns.stream("MC_REQ")
        before = (await nc.jetstream().stream_info(stream)).state.messages
        env = {**os.environ, "MOONCAKE_NATS_URL": nats_url, "MOONCAKE_NAMESPACE": s.namespace,
               "MOONCAKE_ENGINE__MODEL": "dummy"}  # fmt: skip
        cli = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "mooncake.cli", "submit", "hello", env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        # It says so instead of waiting out the request's timeout (a hang fails here).
        out, errs = await asyncio.wait_for(cli.communicate(), 60)
        said = (out + errs).decode()
        assert cli.returncode == 1 and "not submitted" in said and "mooncake up" in said, said
        assert (await nc.jetstream().stream_info(stream)).state.messages == before
    finally:
        await nc.drain()


async def test_a_second_up_on_a_shared_broker_is_told_a_system_runs_there(
    nats_url: str, namespace: str
) -> None:
    s = live_settings(nats_url, namespace)
    assert await asyncio.to_thread(other_system, s, nats_url) is None  # nobody there yet
    async with live(s):
        why = await asyncio.to_thread(other_system, s, nats_url)
        assert why is not None and "MOONCAKE_NAMESPACE" in why and s.namespace in why


async def test_a_completion_the_dead_decode_claimed_but_never_published_is_redone(
    nats_url: str, namespace: str
) -> None:
    """d1 finished a request, claimed its end and was killed before publishing the
    completion (the client never got its final chunk, the record no terminal event). The
    reaper must not take that claim for an end: the work goes to d2, which wins the same
    claim and publishes. A request another party ended (cancelled) is still dropped."""
    s = live_settings(nats_url, namespace)
    async with live(s) as (cl, conductor):
        cl.instances |= {"p1": Fake("prefill", "n1"), "d1": Fake("decode", "n2")}
        cl.instances["d2"] = Fake("decode", "n3")
        await known(conductor, "p1", "d1", "d2")
        p1_work = await cl.bind_work("prefill", "p1")
        d1_work = await cl.bind_work("decode", "d1")
        subjects = WorkSubjects(cl.ns)
        works = {}
        for rid in ("r-claimed", "r-cancelled"):
            await cl.submit(rid, token_ids=tokens(2 * BT), deadline_s=60.0)
            assert (await cl.outcome(rid))["type"] == "request.admitted"
            [msg] = await p1_work.fetch(1, timeout=5)
            works[rid] = PrefillWork.model_validate_json(msg.data)
            await msg.ack()
            w = works[rid]
            decode = DecodeWork(
                request_id=rid, token_ids=w.token_ids, first_token_id=5, prefill_instance="p1",
                decode_instance="d1", timing=w.timing, first_token_at=time.time(),
                admitted_event_id=w.admitted_event_id,
            )  # fmt: skip
            await cl.js.publish(subjects.decode("d1"), decode.to_json())
        held = await d1_work.fetch(2, timeout=5)  # d1 takes both ... and dies holding them
        assert len(held) == 2
        kv = conductor.ender.kv
        done_id = completed_event_id(works["r-claimed"].admitted_event_id, "decode")
        assert await terminal.claim(kv, "r-claimed", "completed", done_id)
        assert await terminal.claim(kv, "r-cancelled", "cancelled", "some-cancel-event")
        await d1_work.unsubscribe()
        del cl.instances["d1"]

        d2_work = await cl.bind_work("decode", "d2")
        [moved] = await d2_work.fetch(1, timeout=15)
        got = DecodeWork.model_validate_json(moved.data)
        assert (got.request_id, got.decode_instance, got.attempt) == ("r-claimed", "d2", 2)
        await moved.ack()
        with pytest.raises(nats.errors.TimeoutError):  # the cancelled one is not re-run
            await d2_work.fetch(1, timeout=2 * s.bus.ack_wait_s + 1)
        await d2_work.unsubscribe()


async def test_the_cost_model_follows_the_prefill_times_the_workers_report(
    nats_url: str, namespace: str
) -> None:
    """Seeded by the reference hardware (an 8xA800 prefills 2,000 tokens in well under a
    second), the Conductor admits a 2,000-token prompt against a 5 s TTFT SLO. Then the
    prefill instance reports what it really takes - 5 ms a token - and the refitted model
    predicts 10 s for the same prompt, and 10 s for the one still queued ahead of it (the
    queue is predicted again with the new model): rejected on TTFT, the refit in the
    decision's record and the metric."""
    from mooncake import metrics

    s = live_settings(nats_url, namespace, admission_policy="early", slo={"ttft_s": 5.0})
    async with live(s) as (cl, conductor):
        cl.instances |= {"p1": Fake("prefill", "n1"), "d1": Fake("decode", "n2")}
        await known(conductor, "p1", "d1")
        await cl.submit("r-before", token_ids=tokens(2000))
        before = await cl.outcome("r-before")
        assert before["type"] == "request.admitted" and before["predicted_ttft_s"] < 1.0
        assert before["inputs"]["cost_model"]["cost_prefill_fitted"] == 0.0
        # Until the model is calibrated, only an idle prefill instance takes work.
        await cl.submit("r-busy", token_ids=tokens(100, salt=2))
        busy = await cl.outcome("r-busy")
        assert (busy["type"], busy["reason"]) == ("request.rejected", "prefill_overloaded")
        assert "still learning this cluster's prefill speed" in busy["detail"]
        refits = metrics.COST_MODEL_REFITS.labels("prefill")._value.get()
        publisher = Publisher(cl.nc, cl.js, cl.ns)
        for i, n in enumerate((100, 200, 400, 800, 1600, 3200, 150, 300, 600, 1200)):
            await publisher.publish(
                ev.RequestPrefilled(
                    request_id=f"done-{i}", instance="p1", prompt_tokens=n, prefill_s=0.005 * n
                )
            )

        async def fitted() -> bool:
            return (
                conductor._online is not None
                and conductor._online.state()["cost_prefill_fitted"] == 1.0
            )

        await until(fitted, 5, "the prefill refit")
        await cl.submit("r-after", token_ids=tokens(2000, salt=1))
        after = await cl.outcome("r-after")
        assert (after["type"], after["reason"]) == ("request.rejected", "ttft_slo")
        # 10 s of its own prefill, behind r-before still queued on p1: predicted again with
        # the refitted model (10 s, not the < 1 s it was admitted with).
        assert after["inputs"]["prefill_s"] == pytest.approx(10.0, rel=0.05)
        assert after["inputs"]["queue_s"] == pytest.approx(10.0, rel=0.05)
        assert after["predicted_ttft_s"] == pytest.approx(20.0, rel=0.05)
        state = after["inputs"]["cost_model"]
        assert state["cost_prefill_fitted"] == 1.0 and state["cost_prefill_refits"] >= 1
        assert state["cost_prefill_observed"] == 10
        assert metrics.COST_MODEL_REFITS.labels("prefill")._value.get() > refits


async def test_a_decision_records_which_kv_indexes_it_read_as_not_exact(
    nats_url: str, namespace: str
) -> None:
    """A node whose KV index resyncs: the decision says so (its blocks counted as unknown)."""
    from mooncake.store.kv_index import IndexState

    s = live_settings(nats_url, namespace)
    async with live(s) as (cl, conductor):
        cl.instances |= {"p1": Fake("prefill", "n1"), "d1": Fake("decode", "n2")}
        await known(conductor, "p1", "d1")
        conductor.feed.kv.states["n1"] = (IndexState.RESYNCING, 0.0)
        conductor.feed.engine_kv.states["n1"] = (IndexState.EXACT, 0.0)  # same id, apart
        conductor.feed.engine_kv.states["p1"] = (IndexState.DEGRADED, 0.0)
        conductor.view.unsure_nodes = frozenset({"n1"})
        await cl.submit("r-unsure", token_ids=tokens(100))
        out = await cl.outcome("r-unsure")
        kv_index = out["inputs"]["kv_index"]
        assert kv_index["unsure_nodes"] == ["n1"], out["inputs"]
        assert kv_index["node_states"] == {"n1": "resyncing"}
        assert kv_index["instance_states"] == {"p1": "degraded"}
        assert out["inputs"]["ssd_prefix_blocks"] == 0


async def test_a_request_whose_end_never_reached_the_conductor_is_swept_out_of_its_view(
    nats_url: str, namespace: str
) -> None:
    """Lifecycle events reach the Conductor on core subscriptions: an end published while it
    was cut off is lost to it. Its sweep reads the terminal slot of every request it has not
    heard of for `inflight_check_after_s`: the one that ended leaves the queues it held, the
    one still running stays."""
    s = live_settings(nats_url, namespace, conductor={"inflight_check_after_s": 0.4})
    async with live(s) as (cl, conductor):
        cl.instances |= {"p1": Fake("prefill", "n1"), "d1": Fake("decode", "n2")}
        await known(conductor, "p1", "d1")
        for rid in ("r-ended-unheard", "r-running"):
            await cl.submit(rid, token_ids=tokens(2 * BT, salt=len(rid)))
            assert (await cl.outcome(rid))["type"] == "request.admitted"
        assert {"r-ended-unheard", "r-running"} <= set(conductor.view.inflight)
        # Ended by a decode whose RequestCompleted the Conductor never got (not published
        # here at all): only the terminal slot says so.
        kv = conductor.ender.kv
        assert await terminal.claim(kv, "r-ended-unheard", "completed", "done-1")

        async def swept() -> bool:
            return "r-ended-unheard" not in conductor.view.inflight

        await until(swept, 5, "the sweep to take the ended request out")
        assert "r-running" in conductor.view.inflight
        assert "r-ended-unheard" not in conductor.view.prefill["p1"].queued

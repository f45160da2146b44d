"""The decode worker over a real NATS and a real store (master in this process, the worker's
own node), with the dummy model. Each test prepares `DecodeWork` the way a prefill instance
does (a local prefill, its whole blocks and tail put into the store) and checks what comes
out: streamed tokens equal to a single-process `generate()`, the terminal events, the
replayable token copy, cancellation, deadlines, KV misses and failures.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import nats
import pytest
import pytest_asyncio
import torch
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from mooncake import events as ev
from mooncake.bus import terminal
from mooncake.bus.publish import Publisher
from mooncake.config import BusSettings, EngineSettings, Settings, StoreSettings
from mooncake.engine import Completion, DecodeBatch, Engine, block_to_bytes, generate
from mooncake.engine import SamplingParams as EngineParams
from mooncake.serving.local_store import local_store
from mooncake.serving.models import build_engine
from mooncake.serving.streaming import resume_tokens
from mooncake.store.client import ClientConfig, StoreClient
from mooncake.store.master import StoreMaster, new_state
from mooncake.work import (
    DecodeWork,
    LoadReport,
    Timing,
    TokenChunk,
    WorkSubjects,
    completed_event_id,
    tail_key,
)
from workers.decode import DecodeWorker
from workers.runtime import worker_context

from helpers import wait_for

INSTANCE = "decode-0"
BLOCK = 16
SECRET = "decode-test"


class SlowBatch(DecodeBatch):
    """A DecodeBatch whose steps take a while (a bigger model), recording each batch size."""

    delay_s = 0.0

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.sizes: list[int] = []

    def step(self) -> list[Completion]:
        self.sizes.append(len(self))
        time.sleep(self.delay_s)
        return super().step()


@dataclass
class Rig:
    nc: NATS
    js: JetStreamContext
    settings: Settings
    worker: DecodeWorker
    batch: SlowBatch
    reference: Engine
    store: StoreClient
    events: list[ev.Event] = field(default_factory=list)
    chunks: dict[str, list[TokenChunk]] = field(default_factory=dict)
    loads: list[LoadReport] = field(default_factory=list)

    @property
    def ns(self) -> ev.Namespace:
        return ev.Namespace(self.settings.namespace)

    def of(self, kind: type[ev.Event], request_id: str) -> list[ev.Event]:
        return [
            e
            for e in self.events
            if isinstance(e, kind) and getattr(e, "request_id", None) == request_id
        ]

    async def prepare(
        self,
        request_id: str,
        prompt: list[int],
        max_tokens: int,
        *,
        store_blocks: bool = True,
        store_tail: bool = True,
        **kw: object,
    ) -> DecodeWork:
        """What a prefill instance hands over: the prompt's KV in the store, the first token."""
        pf = self.reference.prefill(prompt)
        first = int(torch.argmax(pf.logits))
        keys = self.reference.block_keys(prompt)
        tail = len(prompt) - len(keys) * BLOCK
        tkey = tail_key(request_id, 1)
        items: list[tuple[str, bytes]] = []
        if store_blocks:
            blocks = self.reference.blocks(pf.kv)
            items += [(k, block_to_bytes(b)) for k, b in zip(keys, blocks, strict=True)]
        if tail and store_tail:
            part = pf.kv.piece(len(keys) * BLOCK, tail)
            items.append((tkey, block_to_bytes(part)))
        refused = await self.store.put_many(items)
        assert all(r is None or r.reason.value == "exists" for r in refused), refused
        now = time.time()
        fields: dict[str, object] = {
            "request_id": request_id,
            "token_ids": prompt,
            "first_token_id": first,
            "kv_keys": keys,
            "tail_key": tkey if tail else None,
            "tail_tokens": tail,
            "params": ev.SamplingParams(max_tokens=max_tokens),
            "reply_to": self.ns.subject(f"test.reply.{request_id}"),
            "prefill_instance": "prefill-0",
            "decode_instance": INSTANCE,
            "timing": Timing(submitted_at=now - 0.05),
            "first_token_at": now,
            "admitted_event_id": ev.new_event_id(),
        }
        return DecodeWork.model_validate(fields | kw)

    async def send(self, work: DecodeWork) -> None:
        await self.js.publish(WorkSubjects(self.ns).decode(INSTANCE), work.to_json())

    def expected(self, prompt: list[int], max_tokens: int) -> list[int]:
        return generate(self.reference, [prompt], [EngineParams(max_tokens=max_tokens)])[0].tokens

    def streamed(self, work: DecodeWork) -> list[int]:
        """The first token (prefill's) and every token the worker streamed, by index."""
        by_index = {0: work.first_token_id}
        for c in self.chunks.get(work.request_id, []):
            for k, t in enumerate(c.token_ids):
                by_index.setdefault(c.index + k, t)
        return [by_index[i] for i in range(len(by_index))]

    def final(self, request_id: str) -> TokenChunk | None:
        done = [c for c in self.chunks.get(request_id, []) if c.done]
        assert len(done) <= 1, done
        return done[0] if done else None

    async def wait_final(self, request_id: str, within: float = 15) -> TokenChunk:
        async def seen() -> bool:
            return self.final(request_id) is not None

        await wait_for(seen, within, f"the last chunk of {request_id}", interval=0.02)
        final = self.final(request_id)
        assert final is not None
        return final

    async def idle(self) -> None:
        """Everything the worker was given is acked and it holds no request."""
        spec = self.worker._consumer.spec

        async def done() -> bool:
            info = await self.js.consumer_info(spec.stream, spec.durable)
            return not info.num_pending and not info.num_ack_pending and not self.worker.jobs

        await wait_for(done, 15, "the work to be acked", interval=0.05)


@pytest_asyncio.fixture
async def rig(nats_url: str, namespace: str, tmp_path: Path) -> AsyncIterator[Rig]:
    async with running_rig(rig_settings(nats_url, namespace, tmp_path)) as r:
        yield r


def rig_settings(nats_url: str, namespace: str, tmp_path: Path, **overrides: object) -> Settings:
    fields: dict[str, object] = {
        "nats_url": nats_url,
        "namespace": namespace,
        "data_dir": tmp_path / "data",
        "database_url": None,
        "block_tokens": BLOCK,
        "engine": EngineSettings(model="dummy", threads=1, max_batch=8),
        "store": StoreSettings(
            secret=SECRET, dram_bytes=16 << 20, transports=("shm", "tcp"), heartbeat_s=0.2
        ),
        "bus": BusSettings(max_deliver=3, nak_base_delay_s=0.05),
    }
    return Settings(**(fields | overrides))  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def running_rig(settings: Settings) -> AsyncIterator[Rig]:
    """A decode worker with these settings over a real NATS and store, running."""
    ns = ev.Namespace(settings.namespace)
    nats_url = settings.nats_url
    nc = await nats.connect(nats_url)
    master = StoreMaster(nc, ns, new_state(settings.store, seed=1), tick_s=0.05)
    await master.start()
    engine = build_engine(settings)
    reference = build_engine(settings)  # same seed, same weights; its own lazy caches
    client = StoreClient(nc, ns, ClientConfig(SECRET.encode(), ("shm", "tcp")))
    try:
        async with worker_context(settings, "decode", INSTANCE) as ctx:
            bucket = await terminal.open_bucket(ctx.js, ctx.ns)
            async with local_store(ctx.nc, settings, node_id=INSTANCE) as store:
                worker = DecodeWorker(ctx, engine, store, bucket)
                batch = worker.batch = SlowBatch(engine)
                r = Rig(nc, nc.jetstream(), settings, worker, batch, reference, client)

                async def on_event(msg: Msg) -> None:
                    parsed = ev.parse_event(msg.data)
                    if isinstance(parsed, ev.Event):
                        r.events.append(parsed)

                async def on_reply(msg: Msg) -> None:
                    chunk = TokenChunk.model_validate_json(msg.data)
                    r.chunks.setdefault(chunk.request_id, []).append(chunk)

                async def on_load(msg: Msg) -> None:
                    r.loads.append(LoadReport.model_validate_json(msg.data))

                await nc.subscribe(ns.subject("mc.req.>"), cb=on_event)
                await nc.subscribe(ns.subject("test.reply.>"), cb=on_reply)
                await nc.subscribe(WorkSubjects(ns).load("*"), cb=on_load)
                await nc.flush()
                task = asyncio.create_task(worker.run())
                try:
                    yield r
                finally:
                    ctx.stop.set()
                    await asyncio.wait_for(task, 15)
    finally:
        await client.close()
        await master.stop()
        await nc.drain()


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1024, (n,), generator=g).tolist()


async def test_concurrent_requests_stream_what_generate_gives(rig: Rig) -> None:
    r = rig
    r.batch.delay_s = 0.01  # long enough for the sequences to overlap
    shapes = [(5, 12), (16, 20), (37, 8), (70, 30)]  # (prompt tokens, max_tokens)
    works = [await r.prepare(f"req-{i}", tokens(n, i), m) for i, (n, m) in enumerate(shapes)]
    for w in works:
        await r.send(w)
    for w, (_, m) in zip(works, shapes, strict=True):
        final = await r.wait_final(w.request_id)
        assert final.finish_reason == "length" and final.index == m
        assert r.streamed(w) == r.expected(list(w.token_ids), m), w.request_id
        indexes = [c.index for c in r.chunks[w.request_id] if not c.done]
        assert indexes == list(range(1, m)), "one chunk per token, from index 1, in order"
        (done,) = r.of(ev.RequestCompleted, w.request_id)
        assert isinstance(done, ev.RequestCompleted)
        assert done.output_tokens == m and done.finish_reason == "length"
        # Measured, not judged: at least the steps' own pauses (timing targets are benches').
        assert done.ttft_s is not None and done.ttft_s >= 0.04
        assert done.tbt_s is not None and done.tbt_s >= r.batch.delay_s
        assert len(r.of(ev.DecodeStarted, w.request_id)) == 1
    await r.idle()
    assert max(r.batch.sizes) >= 2, "the requests never decoded together"
    assert r.worker.recomputed == 0
    # The tails were request-scoped and are gone; the shared whole blocks stay cached.
    tails = [w.tail_key for w in works if w.tail_key]
    assert tails and not any(await r.store.exists_many(tails))
    assert all(await r.store.exists_many(list(works[3].kv_keys)))
    assert not r.worker.batch.running
    reports = [x for x in r.loads if x.instance == INSTANCE]
    assert reports and reports[-1].role == "decode" and reports[-1].node == INSTANCE
    assert reports[-1].kv_capacity_tokens == r.worker.engine.pool.capacity_tokens
    # Its engine's steps, timed at start, in every report (the Conductor's first decode rows).
    assert [t.x for t in reports[-1].calibration] == [1, 4]
    assert all(t.seconds > 0 for t in reports[-1].calibration)
    assert any(x.running >= 1 and x.context_tokens > 0 for x in reports)
    # The steps the reports say ran (the Conductor's decode timing samples): each waits at
    # least the rig's 10 ms delay, and once reported they are the steps the batch ran, less
    # the first of each busy spell (it has no period before it).
    ran = len(r.batch.sizes)

    async def reported() -> bool:
        counted = sum(x.steps for x in r.loads if x.instance == INSTANCE)
        return ran - 4 <= counted <= ran

    await wait_for(reported, 5, "the load reports to count the steps", interval=0.05)
    timed = [x for x in r.loads if x.instance == INSTANCE and x.steps]
    assert all(x.step_s is not None and x.step_s >= 0.01 for x in timed)
    assert all(x.step_batch is not None and 1 <= x.step_batch <= 4 for x in timed)


async def test_kv_miss_recomputes_with_the_same_output(rig: Rig) -> None:
    r = rig
    prompt = tokens(41, 7)
    work = await r.prepare("miss", prompt, 10, store_tail=False)  # the tail was "evicted"
    await r.send(work)
    final = await r.wait_final("miss")
    assert final.finish_reason == "length"
    assert r.streamed(work) == r.expected(prompt, 10)
    assert r.worker.recomputed == 1
    assert len(r.of(ev.RequestCompleted, "miss")) == 1


async def test_cancel_mid_decode_stops_tokens(rig: Rig) -> None:
    r = rig
    r.batch.delay_s = 0.02
    work = await r.prepare("cancel-me", tokens(20, 3), 500)
    other = await r.prepare("keep-me", tokens(9, 4), 60)
    await r.send(work)
    await r.send(other)

    async def some_tokens() -> bool:
        return len(r.chunks.get("cancel-me", [])) >= 5

    await wait_for(some_tokens, 15, "a few tokens", interval=0.02)
    await Publisher(r.nc, r.js, r.ns).publish(
        ev.CancelRequested(request_id="cancel-me", reason="test")
    )
    final = await r.wait_final("cancel-me")
    assert final.finish_reason == "cancelled"
    count = len(r.chunks["cancel-me"])
    assert count < 500  # stopped before its max_tokens
    # The other request in the same batch goes on to its end, unaffected.
    assert (await r.wait_final("keep-me")).finish_reason == "length"
    assert r.streamed(other) == r.expected(list(other.token_ids), 60)
    await r.idle()
    assert "cancel-me" not in r.worker.batch.running
    assert len(r.chunks["cancel-me"]) == count, "tokens kept coming after the cancel"
    assert not r.of(ev.RequestCompleted, "cancel-me")
    assert work.tail_key and not await r.store.exists(work.tail_key)
    # The record learns how many tokens the client got (the canceller did not know).
    [stopped] = r.of(ev.DecodeStopped, "cancel-me")
    assert isinstance(stopped, ev.DecodeStopped)
    assert (stopped.reason, stopped.output_tokens) == ("client", final.index)


async def test_deadline_cancels_with_an_event(rig: Rig) -> None:
    r = rig
    r.batch.delay_s = 0.02
    now = time.time()
    work = await r.prepare(
        "late", tokens(12, 5), 500, timing=Timing(submitted_at=now, deadline_at=now + 0.5)
    )
    await r.send(work)
    final = await r.wait_final("late")
    assert final.finish_reason == "cancelled"
    await wait_for(lambda: _true(bool(r.of(ev.RequestCancelled, "late"))), 5, "RequestCancelled")
    (cancelled,) = r.of(ev.RequestCancelled, "late")
    assert isinstance(cancelled, ev.RequestCancelled)
    assert cancelled.reason == "deadline" and cancelled.stage == "decode"
    assert await terminal.ended(r.worker.kv, "late") == "cancelled"
    await r.idle()


async def test_resume_tokens_from_an_offset(rig: Rig) -> None:
    r = rig
    prompt = tokens(30, 9)
    work = await r.prepare("resume", prompt, 40)
    await r.send(work)
    await r.wait_final("resume")
    want = r.expected(prompt, 40)

    got = [c async for c in resume_tokens(r.js, r.ns, "resume", 17, idle_timeout_s=5)]
    assert got[-1].done and got[-1].finish_reason == "length"
    assert [c.index for c in got[:-1]] == list(range(17, 40))
    assert [t for c in got[:-1] for t in c.token_ids] == want[17:]
    everything = [c async for c in resume_tokens(r.js, r.ns, "resume", 0, idle_timeout_s=5)]
    assert [t for c in everything for t in c.token_ids] == want


async def test_work_for_an_ended_request_is_skipped(rig: Rig) -> None:
    r = rig
    work = await r.prepare("gone", tokens(25, 11), 10)
    assert await terminal.claim(r.worker.kv, "gone", "cancelled", ev.new_event_id())
    await r.send(work)
    await r.idle()
    await asyncio.sleep(0.2)
    assert not r.chunks.get("gone")
    assert not r.of(ev.DecodeStarted, "gone")
    assert work.tail_key and not await r.store.exists(work.tail_key)


async def test_a_completion_claimed_but_never_published_is_done_again(rig: Rig) -> None:
    """An earlier attempt claimed the request's completion and died before publishing it:
    that claim is this stage's own, so the work runs, wins the same claim and publishes the
    completion (the client and the record would otherwise never hear of an end)."""
    r = rig
    work = await r.prepare("half-done", tokens(25, 14), 6)
    done_id = completed_event_id(work.admitted_event_id, "decode")
    assert await terminal.claim(r.worker.kv, "half-done", "completed", done_id)
    await r.send(work)
    final = await r.wait_final("half-done")
    assert final.finish_reason == "length" and final.index == 6
    await r.idle()
    [completed] = r.of(ev.RequestCompleted, "half-done")
    assert completed.event_id == done_id
    assert r.streamed(work) == r.expected(list(work.token_ids), 6)


async def test_one_bad_request_fails_alone(rig: Rig) -> None:
    r = rig
    r.batch.delay_s = 0.01
    good = await r.prepare("good", tokens(18, 12), 30)
    # Stop strings need a tokenizer; the dummy model has none: this request cannot decode.
    bad = await r.prepare(
        "bad", tokens(18, 13), 30, params=ev.SamplingParams(max_tokens=30, stop=["x"])
    )
    await r.send(good)
    await r.send(bad)
    final = await r.wait_final("bad")
    assert final.finish_reason == "failed" and final.error
    (failed,) = r.of(ev.RequestFailed, "bad")
    assert isinstance(failed, ev.RequestFailed) and failed.stage == "decode"
    assert (await r.wait_final("good")).finish_reason == "length"
    assert r.streamed(good) == r.expected(list(good.token_ids), 30)
    await r.idle()


async def _true(v: bool) -> bool:
    return v


def test_text_deltas_never_split_a_character() -> None:
    """On the real tokenizer (no NATS needed): increments concatenate to the text, never
    hold half a character, and hold back what could still become a stop string."""
    from mooncake.config import load_settings
    from mooncake.engine import EngineError
    from mooncake.model_info import build_tokenizer
    from mooncake.serving.streaming import TextDeltas

    try:
        tok = build_tokenizer(load_settings(engine=EngineSettings(model="smollm2")))
    except EngineError as exc:
        pytest.skip(str(exc))
    assert tok is not None
    text = "Héllo wörld — 日本語 🙂🙂 done.\n\nNext part"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    for stop in ((), ("\n\nNext",), ("🙂🙂", "wör")):
        td = TextDeltas(tok, stop)
        parts = [td.sent_elsewhere(ids[0])]
        for i in range(1, len(ids)):
            parts.append(td.push(ids[i]))
            if any(st in tok.decode(ids[: i + 1]) for st in stop):
                break  # the engine finishes the sequence on the token that makes a stop
        assert not any("\ufffd" in p for p in parts)
        final = text[: min([text.index(st) for st in stop], default=len(text))]
        held = "".join(parts)
        assert final.startswith(held), (held, final)
        assert held + td.rest(final) == final

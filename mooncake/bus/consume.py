"""Durable pull consumers: the consume loop with ack / nak-with-backoff / term + dead letter.

We keep pull requests outstanding on a private inbox (as the newer NATS "consume" APIs do)
instead of calling `fetch()` in a loop: a message is handled as soon as it arrives when the
system is idle, and messages that arrive together are handed over as one batch under load.

A handler returns one `Outcome` per delivery; it never has to know about NATS acks:
- `Ack`: the effect is durable; the message is done.
- `Retry`: transient failure; nak with exponential backoff (or the given delay).
- `DeadLetter`: the message can never be processed; it is copied with the reason to
  `mc.dlq.<consumer>` (recorded in Postgres by the recorder) and terminated.
A handler that raises is treated as `Retry`; a message delivered more than `max_deliver`
times (even one that crashed the process every time) is dead-lettered before the handler
sees it again.

Handlers that hold messages until their work ends (a decode batch) use `feed` (asks for no
more than the caller has room for) and `settle` later, with `bus.heartbeat.Heartbeats`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from opentelemetry import trace
from opentelemetry.trace import SpanKind

from mooncake import metrics
from mooncake.bus.publish import MSG_ID, TRANSIENT, Publisher, bus_tracer
from mooncake.config import BusSettings
from mooncake.events import Namespace
from mooncake.telemetry import extract_context

log = logging.getLogger(__name__)

# Pull requests a consumer keeps open at once: one being delivered, one asked ahead.
MAX_LIVE_REQUESTS = 2


def window_bytes(bus: BusSettings) -> int:
    """The most one consumer holds delivered and not yet handled (raw message bytes): what a
    process's stated memory bound counts per pull consumer it runs."""
    return MAX_LIVE_REQUESTS * bus.pull_max_bytes


@dataclass(frozen=True, slots=True)
class Ack:
    pass


@dataclass(frozen=True, slots=True)
class Retry:
    reason: str
    delay_s: float | None = None


@dataclass(frozen=True, slots=True)
class DeadLetter:
    reason: str
    detail: str = ""


Outcome = Ack | Retry | DeadLetter
ACK = Ack()


@dataclass(frozen=True, slots=True)
class ConsumerSpec:
    """A durable consumer, named canonically (`MC_REQ`, `mc.req.>`)."""

    stream: str
    durable: str
    filter_subject: str
    deliver_all: bool = True

    def within(self, ns: Namespace) -> ConsumerSpec:
        return ConsumerSpec(
            ns.stream(self.stream), self.durable, ns.subject(self.filter_subject), self.deliver_all
        )


class Delivery:
    """One JetStream message as a handler sees it."""

    __slots__ = ("_meta", "msg")

    def __init__(self, msg: Msg) -> None:
        self.msg = msg
        self._meta = msg.metadata

    @property
    def data(self) -> bytes:
        return self.msg.data

    @property
    def subject(self) -> str:
        return self.msg.subject

    @property
    def headers(self) -> dict[str, str]:
        return self.msg.headers or {}

    @property
    def num_delivered(self) -> int:
        return int(self._meta.num_delivered)

    @property
    def stream_seq(self) -> int:
        return int(self._meta.sequence.stream)

    @property
    def stream(self) -> str:
        return str(self._meta.stream)

    async def in_progress(self) -> None:
        """Tell the server we are still working on it (resets the ack-wait timer)."""
        await self.msg.in_progress()


BatchHandler = Callable[[list[Delivery]], Awaitable[Sequence[Outcome]]]
Handler = Callable[[Delivery], Awaitable[Outcome]]
Accept = Callable[[Delivery], None]


def backoff_delay(num_delivered: int, bus: BusSettings) -> float:
    return float(min(bus.nak_base_delay_s * 2 ** max(num_delivered - 1, 0), bus.nak_max_delay_s))


def consumer_span(name: str, d: Delivery) -> trace.Span:
    """The consumer span of one delivery, child of the producer's context in its headers
    (started, not current: the caller decides where it is current, and ends it)."""
    headers = d.headers
    return bus_tracer().start_span(
        f"{name} {d.subject}",
        context=extract_context(headers),
        kind=SpanKind.CONSUMER,
        attributes={
            "messaging.message.id": headers.get(MSG_ID, ""),
            "mc.num_delivered": d.num_delivered,
        },
    )


def per_message(handler: Handler, name: str) -> BatchHandler:
    """Run a per-message handler over a batch, in order, one consumer span per message."""

    async def handle(batch: list[Delivery]) -> list[Outcome]:
        outcomes: list[Outcome] = []
        for d in batch:
            span = consumer_span(name, d)
            with trace.use_span(span, end_on_exit=True):
                try:
                    outcomes.append(await handler(d))
                except TRANSIENT as exc:  # the broker restarting: expected, no traceback
                    log.warning("%s: bus unavailable on %s seq %d (%s: %s); will retry",
                                name, d.subject, d.stream_seq, type(exc).__name__, exc)  # fmt: skip
                    span.record_exception(exc)
                    outcomes.append(Retry(f"{type(exc).__name__}: {exc}"[:500]))
                except Exception as exc:  # any failure is a retry, never a dead consumer
                    log.exception("%s: handler failed on %s seq %d", name, d.subject, d.stream_seq)
                    span.record_exception(exc)
                    outcomes.append(Retry(f"{type(exc).__name__}: {exc}"[:500]))
        return outcomes

    return handle


class PullConsumer:
    """A durable pull consumer on one stream with a flow-controlled request window."""

    def __init__(
        self,
        nc: NATS,
        js: JetStreamContext,
        spec: ConsumerSpec,
        bus: BusSettings,
        ns: Namespace,
        *,
        batch: int | None = None,
        expires_s: float = 5.0,
        prefetch: bool = True,
    ) -> None:
        """`prefetch`: ask for the next batch while one is being handled (the default: no
        idle round trip between batches). Off for handlers that run longer than the ack wait
        (a prefill): a message waiting here unhandled would pass its ack deadline, be
        delivered again and again, and end dead-lettered while still queued."""
        self._nc = nc
        self._js = js
        self.spec = spec.within(ns)
        self._ns = ns
        self._bus = bus
        self._batch = batch or bus.fetch_batch
        self._window = self._batch * (2 if prefetch else 1)  # messages asked for at most
        self._expires_s = expires_s
        # Deliveries from the inbox subscription, and the run loop's wait for the next one.
        self._queue: deque[Msg] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outstanding = 0
        self._last_request = 0.0
        # When each pull request that may still deliver expires (oldest first): at most
        # `MAX_LIVE_REQUESTS`, each of at most `bus.pull_max_bytes`, so what is delivered and
        # not yet handled stays under `window_bytes(bus)` whatever the messages' sizes.
        self._live: deque[float] = deque()
        self._max_bytes = bus.pull_max_bytes
        self._inbox = ""
        self._sub: object | None = None
        self._publisher = Publisher(nc, js, ns)
        name = self.spec.durable
        self._handle_seconds = metrics.BUS_HANDLE_SECONDS.labels(name)
        self._acked = metrics.BUS_HANDLED.labels(name, "ack")
        self._retried = metrics.BUS_HANDLED.labels(name, "retry")

    async def ensure(self) -> None:
        """Create the durable consumer if needed (idempotent)."""
        config = ConsumerConfig(
            durable_name=self.spec.durable,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self._bus.ack_wait_s,
            # We count deliveries ourselves and dead-letter; the server never gives up
            # silently on a message.
            max_deliver=-1,
            max_ack_pending=max(self._batch * 4, 1000),
            filter_subject=self.spec.filter_subject,
            deliver_policy=DeliverPolicy.ALL if self.spec.deliver_all else DeliverPolicy.NEW,
        )
        await self._js.add_consumer(self.spec.stream, config)

    async def _on_msg(self, msg: Msg) -> None:
        self._queue.append(msg)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        await self.ensure()
        self._inbox = self._nc.new_inbox()
        self._sub = await self._nc.subscribe(
            self._inbox, cb=self._on_msg, pending_msgs_limit=-1, pending_bytes_limit=-1
        )

    async def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()  # type: ignore[attr-defined]
            self._sub = None

    async def _request_more(self) -> None:
        self._expire_requests()
        want = self._window - self._outstanding
        if want < self._batch and self._outstanding > 0:
            return
        await self._request(want)

    def _expire_requests(self) -> None:
        now = time.monotonic()
        if now - self._last_request > self._expires_s + 1.0:
            # Every request we made has expired (or was lost in a reconnect).
            self._outstanding = 0
        live = self._live
        while live and live[0] <= now:
            live.popleft()

    async def _request(self, want: int) -> None:
        now = time.monotonic()
        if len(self._live) >= MAX_LIVE_REQUESTS:
            return  # asked again once one of them ends (or expires)
        request = {
            "batch": want,
            "expires": int(self._expires_s * 1e9),
            "max_bytes": self._max_bytes,
        }
        subject = f"$JS.API.CONSUMER.MSG.NEXT.{self.spec.stream}.{self.spec.durable}"
        try:
            await self._nc.publish(subject, json.dumps(request).encode(), reply=self._inbox)
        except Exception as exc:  # disconnected: try again on the next turn
            log.debug("pull request failed: %s", exc)
            return
        self._outstanding += want
        self._last_request = now
        self._live.append(now + self._expires_s + 1.0)

    def _split(self, msgs: list[Msg]) -> list[Delivery]:
        deliveries = []
        for m in msgs:
            headers = m.headers or {}
            status = headers.get("Status")
            if status is None and m.reply:
                self._outstanding -= 1
                if self._outstanding == 0:
                    self._live.clear()  # every message asked for came: no request is left
                deliveries.append(Delivery(m))
                continue
            if status not in ("404", "408", "409"):
                continue  # "100" is an idle heartbeat / flow control: nothing to do
            if self._live:
                self._live.popleft()  # one request ended
            pending = headers.get("Nats-Pending-Messages")
            if pending:
                self._outstanding -= int(pending)
            elif status == "409":
                # Max bytes reached (its pending count not given by this server), or a
                # leadership change, a deleted consumer, max waiting ...
                description = headers.get("Description", "")
                if "MaxBytes" not in description:
                    log.info("pull request ended: %s", description)
                self._outstanding = 0
        self._outstanding = max(self._outstanding, 0)
        return deliveries

    async def _next_batch(self) -> list[Msg]:
        """What has arrived, up to a batch; waits up to a second for the first message."""
        if not self._queue:
            loop = self._loop or asyncio.get_running_loop()
            waiter = self._waiter = loop.create_future()
            timer = loop.call_later(1.0, _wake, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
        queue = self._queue
        return [queue.popleft() for _ in range(min(len(queue), self._batch))]

    def wake(self) -> None:
        """Let `feed` look at the caller's room again now (rather than within a second)."""
        if self._waiter is not None:
            _wake(self._waiter)

    async def feed(
        self,
        accept: Accept,
        room: Callable[[], int],
        stop: asyncio.Event,
        exhausted: Accept | None = None,
    ) -> None:
        """Ask for at most `room()` messages beyond those on their way; each goes to `accept`
        (which books it at once) and is settled later with `settle`. One delivered more than
        `max_deliver` times goes to `exhausted` (to end its work) or is dead-lettered."""
        await self.start()
        try:
            while not stop.is_set():
                self._expire_requests()
                want = room() - self._outstanding
                if want > 0:
                    await self._request(want)
                for d in self._split(await self._next_batch()):
                    if d.num_delivered <= self._bus.max_deliver:
                        accept(d)
                    elif exhausted is not None:
                        exhausted(d)
                    else:
                        await self._dead_letter(d, DeadLetter("max_deliver", f"{d.num_delivered}"))
        finally:
            await self.close()

    async def settle(self, d: Delivery, outcome: Outcome) -> None:
        await self._settle(d, outcome)  # a delivery `feed` handed over

    async def run(
        self, handler: BatchHandler, stop: asyncio.Event, exhausted: BatchHandler | None = None
    ) -> None:
        """Hand each batch to `handler`. A message delivered more than `max_deliver` times
        goes to `exhausted` where one is given (a work queue whose handler ends the work
        itself: a worker killed while holding a message spends its deliveries too, and
        accepted work must end, not vanish into the dead-letter stream), else is
        dead-lettered."""
        await self.start()
        try:
            while not stop.is_set():
                await self._request_more()
                deliveries = self._split(await self._next_batch())
                if deliveries:
                    await self._dispatch(deliveries, handler, exhausted)
        finally:
            await self.close()

    async def _dispatch(
        self, deliveries: list[Delivery], handler: BatchHandler, exhausted: BatchHandler | None
    ) -> None:
        live: list[Delivery] = []
        spent: list[Delivery] = []
        for d in deliveries:
            if d.num_delivered <= self._bus.max_deliver:
                live.append(d)
            elif exhausted is not None:
                spent.append(d)
            else:
                await self._dead_letter(d, DeadLetter("max_deliver", f"{d.num_delivered} tries"))
        if spent:
            assert exhausted is not None
            await self._handle(spent, exhausted)
        if live:
            await self._handle(live, handler)

    async def _handle(self, live: list[Delivery], handler: BatchHandler) -> None:
        name = self.spec.durable
        started = time.perf_counter()
        try:
            outcomes = list(await handler(live))
        except Exception as exc:
            log.exception("%s: batch handler failed", name)
            outcomes = [Retry(f"{type(exc).__name__}: {exc}"[:500])] * len(live)
        self._handle_seconds.observe(time.perf_counter() - started)
        if len(outcomes) != len(live):
            log.error("%s: handler returned %d outcomes for %d", name, len(outcomes), len(live))
            outcomes = [Retry("handler outcome count mismatch")] * len(live)
        for d, outcome in zip(live, outcomes, strict=True):
            await self._settle(d, outcome)

    async def _settle(self, d: Delivery, outcome: Outcome) -> None:
        match outcome:
            case Ack():
                await d.msg.ack()
                self._acked.inc()
            case Retry(delay_s=delay):
                wait = delay if delay is not None else backoff_delay(d.num_delivered, self._bus)
                await d.msg.nak(delay=wait)
                self._retried.inc()
            case DeadLetter():
                await self._dead_letter(d, outcome)

    async def _dead_letter(self, d: Delivery, dl: DeadLetter) -> None:
        name = self.spec.durable
        headers = {
            MSG_ID: f"dlq:{d.stream}:{d.stream_seq}:{name}",
            "Mc-Dlq-Reason": dl.reason,
            "Mc-Dlq-Detail": _header_safe(dl.detail),
            "Mc-Dlq-Stream": d.stream,
            "Mc-Dlq-Seq": str(d.stream_seq),
            "Mc-Dlq-Subject": d.subject,
            "Mc-Dlq-Consumer": name,
        }
        if tp := d.headers.get("traceparent"):
            headers["traceparent"] = tp
        try:
            await self._publisher.publish_raw(self._ns.dead_letter_subject(name), d.data, headers)
        except Exception:
            # Could not record it: leave it for redelivery rather than lose it.
            log.exception("%s: dead-letter publish failed; will retry", name)
            await d.msg.nak(delay=backoff_delay(d.num_delivered, self._bus))
            return
        log.warning("%s: dead-lettered %s seq %d: %s", name, d.subject, d.stream_seq, dl.reason)
        await d.msg.term()
        metrics.BUS_HANDLED.labels(name, "dead_letter").inc()
        metrics.DEAD_LETTERS.labels(name, dl.reason).inc()


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _header_safe(text: str, limit: int = 1000) -> str:
    """Header values are one line of printable text."""
    return "".join(ch if ch.isprintable() else " " for ch in text)[:limit]

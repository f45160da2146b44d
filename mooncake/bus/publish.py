"""Publishing events to JetStream: `Nats-Msg-Id` = event id, trace context in headers.

A publish that times out or meets a disconnect is retried with the same message id, so
the server's dedupe window drops the copy if the first attempt did land; the recorder's
unique index on the event id is the second line of defence beyond that window.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import nats.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import PubAck
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    stop_after_delay,
    wait_exponential,
)

from mooncake import metrics
from mooncake.events import Event, Namespace
from mooncake.telemetry import TRACER_NAME, inject_headers

log = logging.getLogger(__name__)

MSG_ID = "Nats-Msg-Id"
TYPE_HEADER = "Mc-Type"
# Transient failures: the broker is restarting, a leader election, a slow ack.
TRANSIENT = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionClosedError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.StaleConnectionError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,  # 503: "JetStream system temporarily unavailable"
    asyncio.TimeoutError,
)

T = TypeVar("T")


async def retry_transient(attempt: Callable[[], Awaitable[T]], give_up_s: float) -> T:
    """`attempt()` until it does not fail transiently (0.1 s between tries, doubling up to
    2 s), raising its error once `give_up_s` would pass: how a call that is not a publish
    (a terminal claim, a read-back) rides out a broker restart or a leader election."""
    delay, deadline = 0.1, time.monotonic() + give_up_s
    while True:
        try:
            return await attempt()
        except TRANSIENT:
            if time.monotonic() + delay > deadline:
                raise
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)


_tracer_for: tuple[trace.TracerProvider, trace.Tracer] | None = None


def bus_tracer() -> trace.Tracer:
    """`telemetry.tracer()`, made once per tracer provider rather than on every message."""
    global _tracer_for
    provider = trace.get_tracer_provider()
    if _tracer_for is None or _tracer_for[0] is not provider:
        _tracer_for = (provider, trace.get_tracer(TRACER_NAME))
    return _tracer_for[1]


class Publisher:
    def __init__(
        self,
        nc: NATS,
        js: JetStreamContext,
        ns: Namespace,
        *,
        timeout_s: float = 5.0,
        give_up_s: float = 60.0,
    ) -> None:
        self._nc = nc
        self._js = js
        self.ns = ns
        self._timeout_s = timeout_s
        self._give_up_s = give_up_s
        self._published: dict[str, Any] = {}  # metric children by event type

    @staticmethod
    def _prepare(event: Event) -> tuple[Event, dict[str, str]]:
        """Stamp the current span's traceparent on the event and on the headers."""
        headers = {MSG_ID: event.event_id, TYPE_HEADER: event.type}
        inject_headers(headers)
        if event.traceparent is None and "traceparent" in headers:
            event = event.model_copy(update={"traceparent": headers["traceparent"]})
        return event, headers

    async def publish(self, event: Event) -> PubAck:
        current = trace.get_current_span()
        if current.get_span_context().is_valid and not current.is_recording():
            # Inside a trace nobody records (not sampled): a producer span of our own would
            # be built and thrown away; the enclosing span's context propagates instead.
            ack = await self._send(event)
        else:
            attributes = {"mc.event_id": event.event_id}
            if rid := getattr(event, "request_id", None):
                attributes["mc.request_id"] = rid
            with bus_tracer().start_as_current_span(
                f"publish {event.type}", kind=SpanKind.PRODUCER, attributes=attributes
            ):
                ack = await self._send(event)
        self._count(event.type)
        return ack

    async def _send(self, event: Event) -> PubAck:
        event, headers = self._prepare(event)
        return await self._publish_with_retry(
            self.ns.of(event), event.to_json(), headers, event.type
        )

    def count(self, type_: str) -> None:
        """Count an event published through `publish_batch` (which cannot know its type)."""
        self._count(type_)

    def _count(self, type_: str) -> None:
        child = self._published.get(type_)
        if child is None:
            child = self._published[type_] = metrics.BUS_PUBLISHED.labels(type_)
        child.inc()

    async def publish_raw(self, subject: str, payload: bytes, headers: dict[str, str]) -> PubAck:
        """Publish bytes that are not an event of ours (dead letters, test corpora)."""
        return await self._publish_with_retry(subject, payload, headers, "raw")

    async def _publish_with_retry(
        self, subject: str, payload: bytes, headers: dict[str, str], type_: str
    ) -> PubAck:
        started = time.monotonic()
        try:  # the first attempt, without building a retry loop for it
            return await self._js.publish(
                subject, payload, timeout=self._timeout_s, headers=headers
            )
        except TRANSIENT as exc:
            log.debug("publish to %s failed (%s); retrying", subject, exc)
        # Retries keep the backoff a single loop over every attempt would have: 0.05 s
        # before the second attempt, doubling up to 2 s, within give_up_s of the first.
        await asyncio.sleep(0.05)
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(TRANSIENT),
            wait=wait_exponential(multiplier=0.1, max=2.0),
            stop=stop_after_delay(max(self._give_up_s - (time.monotonic() - started), 0.0)),
            reraise=True,
        ):
            with attempt:
                metrics.BUS_PUBLISH_RETRIES.labels(type_).inc()
                return await self._js.publish(
                    subject, payload, timeout=self._timeout_s, headers=headers
                )
        raise AssertionError("unreachable")  # pragma: no cover

    def _stall_limit(self) -> float | None:
        """How long `publish_async` may wait for a free slot: no limit when one is free.

        With a limit nats-py runs every acquire as a separate task with a timer, and yields
        to the event loop between publishes (one socket write per event); without one, a
        free slot is taken synchronously and the batch leaves in a few writes.
        """
        slots = getattr(self._js, "_publish_async_pending_semaphore", None)
        if isinstance(slots, asyncio.Semaphore) and not slots.locked():
            return None
        return self._give_up_s

    def prepare(self, event: Event) -> tuple[str, bytes, dict[str, str]]:
        """Subject, payload and headers of an event, stamped with the current span's context
        (call it inside the span the event belongs to)."""
        event, headers = self._prepare(event)
        return self.ns.of(event), event.to_json(), headers

    async def publish_batch(
        self, items: Sequence[tuple[str, bytes, dict[str, str]]]
    ) -> list[PubAck | BaseException]:
        """Pipelined publish: every message is sent before any ack is awaited; one that
        fails is retried on its own with the same message id (dedupe drops a copy that did
        land). A result per message, in order: its ack, or the exception it still failed
        with (never raised, so one bad message does not fail the others)."""
        futures: list[asyncio.Future[PubAck] | BaseException] = []
        for subject, payload, headers in items:
            try:
                futures.append(
                    await self._js.publish_async(
                        subject, payload, wait_stall=self._stall_limit(), headers=headers
                    )
                )
            except Exception as exc:  # no slot within give_up_s, or disconnected
                futures.append(exc)
        pending = [f for f in futures if isinstance(f, asyncio.Future)]
        if pending:
            _, late = await asyncio.wait(pending, timeout=self._timeout_s)
            for late_fut in late:
                late_fut.cancel()
        results: list[PubAck | BaseException] = []
        for (subject, payload, headers), sent in zip(items, futures, strict=True):
            first: PubAck | BaseException
            if isinstance(sent, asyncio.Future):
                first = TimeoutError() if sent.cancelled() else sent.exception() or sent.result()
            else:
                first = sent
            if isinstance(first, PubAck):
                results.append(first)
                continue
            log.debug("pipelined publish to %s failed (%s); retrying", subject, first)
            try:
                type_ = headers.get(TYPE_HEADER, "raw")
                results.append(await self._publish_with_retry(subject, payload, headers, type_))
            except Exception as exc:
                results.append(exc)
        return results

    async def publish_many_barrier(self, events: Sequence[Event]) -> None:
        """Publish events in order, acknowledged as a whole: every event but the last goes
        out as a plain publish (JetStream stores it all the same, deduplicated by its id),
        and the last one's acknowledgement stands for all. The broker stores one
        connection's messages to a stream in arrival order, and what refuses one of them
        (the stream gone, storage or limits full) refuses the last one too, so its ack means
        the others were stored (or were copies). A message written just before a lost
        connection can vanish without an error, so if the connection was re-established
        meanwhile, or the last one fails, every event is published again, each with its own
        ack (`publish_many`; dedupe drops those that did land). Raises what that could not
        cure.

        For high-volume streams of facts nobody waits on (the store master's journal): a
        plain publish costs a fraction of an acknowledged one."""
        if not events:
            return
        items = [self.prepare(e) for e in events]
        reconnects = self._nc.stats.get("reconnects", 0)
        try:
            for subject, payload, headers in items[:-1]:
                await self._nc.publish(subject, payload, headers=headers)
            subject, payload, headers = items[-1]
            await self._js.publish(subject, payload, timeout=self._timeout_s, headers=headers)
        except (*TRANSIENT, nats.js.errors.APIError) as exc:
            log.debug("barrier publish of %d event(s) failed (%s); one by one", len(items), exc)
        else:
            if self._nc.stats.get("reconnects", 0) == reconnects:
                for e in events:
                    self._count(e.type)
                return
            log.info("reconnected during a barrier publish of %d event(s); one by one", len(items))
        await self.publish_many(events)

    async def publish_many(self, events: Sequence[Event]) -> list[PubAck]:
        """Pipelined publish of many events (each still deduplicated by its id); raises the
        first failure that retries could not cure.

        Ordering is preserved only for events of the same request when sent in order.
        """
        results = await self.publish_batch([self.prepare(e) for e in events])
        acks: list[PubAck] = []
        for event, result in zip(events, results, strict=True):
            if isinstance(result, BaseException):
                raise result
            self._count(event.type)
            acks.append(result)
        return acks

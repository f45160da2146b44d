"""Publishing events to JetStream: `Nats-Msg-Id` = event id, trace context in headers.

A publish that times out or meets a disconnect is retried with the same message id, so
the server's dedupe window drops the copy if the first attempt did land; the recorder's
unique index on the event id is the second line of defence beyond that window.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import nats.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import PubAck
from opentelemetry.trace import SpanKind
from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    stop_after_delay,
    wait_exponential,
)

from mooncake import metrics
from mooncake.events import Event, Namespace
from mooncake.telemetry import inject_headers, tracer

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
    asyncio.TimeoutError,
)


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

    @staticmethod
    def _prepare(event: Event) -> tuple[Event, dict[str, str]]:
        """Stamp the current span's traceparent on the event and on the headers."""
        headers = {MSG_ID: event.event_id, TYPE_HEADER: event.type}
        inject_headers(headers)
        if event.traceparent is None and "traceparent" in headers:
            event = event.model_copy(update={"traceparent": headers["traceparent"]})
        return event, headers

    async def publish(self, event: Event) -> PubAck:
        with tracer().start_as_current_span(f"publish {event.type}", kind=SpanKind.PRODUCER) as sp:
            sp.set_attribute("mc.event_id", event.event_id)
            if rid := getattr(event, "request_id", None):
                sp.set_attribute("mc.request_id", rid)
            event, headers = self._prepare(event)
            payload = event.to_json()
            ack = await self._publish_with_retry(self.ns.of(event), payload, headers, event.type)
        metrics.BUS_PUBLISHED.labels(event.type).inc()
        return ack

    async def publish_raw(self, subject: str, payload: bytes, headers: dict[str, str]) -> PubAck:
        """Publish bytes that are not an event of ours (dead letters, test corpora)."""
        return await self._publish_with_retry(subject, payload, headers, "raw")

    async def _publish_with_retry(
        self, subject: str, payload: bytes, headers: dict[str, str], type_: str
    ) -> PubAck:
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(TRANSIENT),
            wait=wait_exponential(multiplier=0.05, max=2.0),
            stop=stop_after_delay(self._give_up_s),
            reraise=True,
        ):
            with attempt:
                if attempt.retry_state.attempt_number > 1:
                    metrics.BUS_PUBLISH_RETRIES.labels(type_).inc()
                return await self._js.publish(
                    subject, payload, timeout=self._timeout_s, headers=headers
                )
        raise AssertionError("unreachable")  # pragma: no cover

    async def publish_many(self, events: Sequence[Event]) -> list[PubAck]:
        """Pipelined publish of many events (each still deduplicated by its id).

        Events are sent without waiting for each ack; any that fail are retried one by one.
        Ordering is preserved only for events of the same request when sent in order.
        """
        futures: list[asyncio.Future[PubAck]] = []
        prepared: list[tuple[Event, dict[str, str]]] = []
        for event in events:
            event, headers = self._prepare(event)
            prepared.append((event, headers))
            fut = await self._js.publish_async(
                self.ns.of(event), event.to_json(), wait_stall=self._give_up_s, headers=headers
            )
            futures.append(fut)
        results = await asyncio.gather(
            *(asyncio.wait_for(f, self._timeout_s) for f in futures), return_exceptions=True
        )
        acks: list[PubAck] = []
        for (event, headers), result in zip(prepared, results, strict=True):
            if isinstance(result, PubAck):
                acks.append(result)
            else:
                log.debug("pipelined publish of %s failed (%s); retrying", event.event_id, result)
                acks.append(
                    await self._publish_with_retry(
                        self.ns.of(event), event.to_json(), headers, event.type
                    )
                )
            metrics.BUS_PUBLISHED.labels(event.type).inc()
        return acks

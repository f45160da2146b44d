"""The recorder: every lifecycle and metadata fact into Postgres, exactly once.

Consumes MC_REQ and MC_META (facts) and MC_DLQ (dead letters) with durable consumers,
inserts in batches with ON CONFLICT DO NOTHING, updates projections in the same
transaction, and acks only after the commit. A database outage never loses or reorders
anything: the batch is held and retried (with `in_progress` so the broker does not
redeliver it meanwhile); a batch that fails for a non-transient reason is split to find
the poison event, which is dead-lettered.

Run one recorder per deployment (a second one is a hot standby on the same durable
consumers; projections stay correct because they are folded in stream order).

The per-tenant metrics (`mc_tenant_*`) are counted here: a request's end is recorded in
exactly one committed batch, with its tenant, TTFT, TBT and prompt and cached tokens in its
row, so each request counts once, whichever process ended it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from datetime import UTC, datetime
from typing import TypeVar

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine

from mooncake import events as ev
from mooncake import metrics
from mooncake.bus.consume import (
    ACK,
    ConsumerSpec,
    DeadLetter,
    Delivery,
    Outcome,
    PullConsumer,
    Retry,
)
from mooncake.config import SLO, Settings
from mooncake.db.engine import async_engine
from mooncake.db.projections import Row
from mooncake.db.record import (
    NUL_ON_THE_WIRE,
    DeadLetterIn,
    Incoming,
    record_dead_letters,
    record_events,
    storable,
)
from workers.runtime import WorkerContext, configure_logging, worker_context

log = logging.getLogger("mooncake.recorder")
T = TypeVar("T")

EVENT_CONSUMERS = (
    ConsumerSpec("MC_REQ", "recorder", "mc.req.>"),
    ConsumerSpec("MC_META", "recorder", "mc.meta.>"),
)
DLQ_CONSUMER = ConsumerSpec("MC_DLQ", "recorder", "mc.dlq.>")


def _transient(exc: BaseException) -> bool:
    if isinstance(exc, OperationalError | InterfaceError | OSError | ConnectionError):
        return True
    return isinstance(exc, DBAPIError) and exc.connection_invalidated


def observe_ended(rows: Iterable[Row], slo: SLO, tenants: metrics.TenantLabels) -> None:
    """The per-tenant metrics of requests that ended (their `requests` rows)."""
    for row in rows:
        tenant = tenants.label(row["tenant"])
        metrics.TENANT_REQUESTS_ENDED.labels(tenant, row["status"]).inc()
        if row["status"] == "completed" and slo.met_by(row["ttft_s"], row["tbt_s"]):
            metrics.TENANT_GOODPUT.labels(tenant).inc()
        # Prefilled (`prefill_s` comes with RequestPrefilled): a request rejected, cancelled
        # or failed before its prefill has its prompt's length from its submission already,
        # and would count as a miss of the hit rate.
        if row["prefill_s"] is not None and row["prompt_tokens"]:
            metrics.TENANT_PROMPT_TOKENS.labels(tenant).inc(row["prompt_tokens"])
            metrics.TENANT_CACHED_TOKENS.labels(tenant).inc(row["cached_tokens"])


class Recorder:
    def __init__(
        self,
        engine: AsyncEngine,
        ns: ev.Namespace,
        stop: asyncio.Event,
        max_bytes: int,
        *,
        slo: SLO,
        tenants: metrics.TenantLabels,
    ) -> None:
        self._engine = engine
        self._ns = ns
        self._stop = stop
        self._max_bytes = max_bytes
        self._slo, self._tenants = slo, tenants

    async def _with_db_retry(
        self, deliveries: Sequence[Delivery], work: Callable[[], Awaitable[T]]
    ) -> T | None:
        """Run `work` until it succeeds; None when stopping or on a non-transient error."""
        delay = 0.1
        while True:
            try:
                return await work()
            except Exception as exc:
                if not _transient(exc):
                    raise
                if self._stop.is_set():
                    return None
                log.warning("database unavailable (%s); holding %d events", exc, len(deliveries))
                for d in deliveries:
                    try:
                        await d.in_progress()
                    except Exception:  # the broker may be down too; redelivery is harmless
                        pass
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def handle_events(self, batch: list[Delivery]) -> list[Outcome]:
        outcomes: list[Outcome] = [ACK] * len(batch)
        items: list[tuple[int, Incoming]] = []
        for idx, d in enumerate(batch):
            subject = self._ns.canonical(d.subject)
            parsed = ev.parse_event(d.data, subject=subject, max_bytes=self._max_bytes)
            if isinstance(parsed, ev.InvalidEvent):
                outcomes[idx] = DeadLetter(parsed.reason, parsed.detail)
            else:
                if NUL_ON_THE_WIRE in d.data:
                    parsed = storable(parsed)
                items.append((idx, Incoming(parsed, d.stream, d.stream_seq, subject)))
        if not items:
            return outcomes
        try:
            done = await self._with_db_retry(batch, lambda: self._commit([i for _, i in items]))
        except Exception as exc:
            log.warning("batch failed (%s); recording one by one to isolate it", exc)
            for idx, item in items:
                outcomes[idx] = await self._record_one(batch[idx], item)
            return outcomes
        if done is None:
            return [Retry("shutting down")] * len(batch)
        return outcomes

    async def _record_one(self, d: Delivery, item: Incoming) -> Outcome:
        try:
            done = await self._with_db_retry([d], lambda: self._commit([item]))
        except Exception as exc:
            return DeadLetter("unrecordable", f"{type(exc).__name__}: {exc}"[:1000])
        return ACK if done is not None else Retry("shutting down")

    async def _commit(self, items: list[Incoming]) -> bool:
        started = time.perf_counter()
        async with self._engine.begin() as conn:
            result = await record_events(conn, items)
        metrics.RECORDER_BATCH_SECONDS.observe(time.perf_counter() - started)
        metrics.RECORDER_EVENTS.labels("inserted").inc(result.inserted)
        metrics.RECORDER_EVENTS.labels("duplicate").inc(result.duplicates)
        metrics.RECORDER_ILLEGAL.inc(result.illegal)
        observe_ended(result.ended, self._slo, self._tenants)
        newest = max(i.event.occurred_at for i in items)
        metrics.RECORDER_LAG_SECONDS.set((datetime.now(UTC) - newest).total_seconds())
        return True

    async def handle_dead_letters(self, batch: list[Delivery]) -> list[Outcome]:
        items = [_dead_letter_in(d) for d in batch]

        async def work() -> bool:
            async with self._engine.begin() as conn:
                await record_dead_letters(conn, items)
            return True

        done = await self._with_db_retry(batch, work)
        return [ACK] * len(batch) if done else [Retry("shutting down")] * len(batch)


def _dead_letter_in(d: Delivery) -> DeadLetterIn:
    h = d.headers
    return DeadLetterIn(
        dlq_id=h.get("Nats-Msg-Id") or f"dlq:{d.stream}:{d.stream_seq}",
        consumer=h.get("Mc-Dlq-Consumer", "unknown")[:64],
        stream=h.get("Mc-Dlq-Stream", "unknown")[:64],
        stream_seq=int(h.get("Mc-Dlq-Seq", "0") or 0),
        subject=h.get("Mc-Dlq-Subject", d.subject)[:256],
        reason=h.get("Mc-Dlq-Reason", "unknown")[:64],
        detail=h.get("Mc-Dlq-Detail", ""),
        payload=d.data,
    )


async def run(ctx: WorkerContext, engine: AsyncEngine) -> None:
    s = ctx.settings
    tenants = metrics.TenantLabels(s.conductor.tenant_weights, s.metrics_tenants)
    recorder = Recorder(engine, ctx.ns, ctx.stop, s.bus.max_event_bytes, slo=s.slo, tenants=tenants)
    bus, batch = s.bus, s.recorder_batch
    consumers = [
        (PullConsumer(ctx.nc, ctx.js, spec, bus, ctx.ns, batch=batch), recorder.handle_events)
        for spec in EVENT_CONSUMERS
    ]
    consumers.append(
        (PullConsumer(ctx.nc, ctx.js, DLQ_CONSUMER, bus, ctx.ns), recorder.handle_dead_letters)
    )
    await asyncio.gather(*(c.run(handler, ctx.stop) for c, handler in consumers))


async def main(settings: Settings, instance_id: str | None = None) -> None:
    if not settings.database_url:
        raise SystemExit("the recorder needs MOONCAKE_DATABASE_URL")
    engine = async_engine(settings.database_url)
    try:
        async with worker_context(settings, "recorder", instance_id) as ctx:
            await run(ctx, engine)
    finally:
        await engine.dispose()


if __name__ == "__main__":
    from mooncake.config import load_settings

    s = load_settings()
    configure_logging(s.log_level)
    asyncio.run(main(s))

"""The Conductor process: ingress validation, request-id dedupe and admission.

Consumes `mc.req.submitted` (durable consumer "conductor"), validates every message once
(`mooncake.core.ingress`), and publishes `mc.req.admitted` / `mc.req.rejected` with the
decision; the decision is also sent to the request's `reply_to` subject so a client hears
back at once. Events it emits have ids derived from the submission's id, so a redelivered
submission produces the same events again and the broker/recorder drop the copies.

The KVCache-centric scheduling and early rejection of PAPER.md §3/§5 plug in at
`decide()`; until those land the only policy is `none` (admit everything).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging

from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from mooncake import events as ev
from mooncake import metrics
from mooncake.bus.consume import (
    ACK,
    ConsumerSpec,
    DeadLetter,
    Delivery,
    Outcome,
    PullConsumer,
    per_message,
)
from mooncake.bus.publish import MSG_ID
from mooncake.config import Settings
from mooncake.core import ingress
from workers.runtime import WorkerContext, configure_logging, worker_context

log = logging.getLogger("mooncake.conductor")

SUBMITTED = ConsumerSpec("MC_REQ", "conductor", ev.RequestSubmitted.SUBJECT)
REQUEST_IDS_BUCKET = "MC_REQUEST_IDS"  # canonical; namespaced like the streams
REQUEST_ID_TTL_S = 24 * 3600.0


def decide(request: ev.RequestSubmitted, policy: str) -> ev.RequestAdmitted | ev.RequestRejected:
    """Admission. Policy `none` admits everything."""
    return ev.RequestAdmitted(
        event_id=ev.derived_event_id(request.event_id, "admitted"),
        request_id=request.request_id,
        policy=policy,
        prompt_tokens=len(request.token_ids) if request.token_ids is not None else None,
        inputs={"slo_class": request.slo_class},
    )


class Conductor:
    def __init__(self, ctx: WorkerContext, request_ids: KeyValue) -> None:
        self._ctx = ctx
        self._ids = request_ids

    async def _first_submission(self, request: ev.RequestSubmitted) -> bool:
        """True for the first submission of a request id (or a redelivery of it)."""
        key = hashlib.sha256(request.request_id.encode()).hexdigest()[:48]
        try:
            await self._ids.create(key, request.event_id.encode())
            return True
        except KeyWrongLastSequenceError:
            entry = await self._ids.get(key)
            return entry.value == request.event_id.encode()

    async def handle(self, d: Delivery) -> Outcome:
        parsed = ev.parse_event(
            d.data,
            subject=self._ctx.ns.canonical(d.subject),
            max_bytes=self._ctx.settings.bus.max_event_bytes,
        )
        decision = ingress.judge(parsed, msg_id=d.headers.get(MSG_ID), now=ev.utcnow())
        match decision:
            case ingress.Discard(reason=reason, detail=detail):
                metrics.REQUESTS_REJECTED.labels("ingress", "unreadable").inc()
                return DeadLetter(reason, detail)
            case ingress.Reject(event=rejected):
                await self._ctx.publisher.publish(rejected)
                metrics.REQUESTS_REJECTED.labels("ingress", rejected.reason.value).inc()
                return ACK
            case ingress.Accept(request=request):
                return await self._admit(request)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _admit(self, request: ev.RequestSubmitted) -> Outcome:
        if not await self._first_submission(request):
            log.info("duplicate submission of %s ignored", request.request_id)
            return ACK
        outcome = decide(request, self._ctx.settings.admission_policy)
        await self._ctx.publisher.publish(outcome)
        if isinstance(outcome, ev.RequestAdmitted):
            metrics.REQUESTS_ADMITTED.labels(outcome.policy).inc()
        else:
            metrics.REQUESTS_REJECTED.labels(outcome.stage, outcome.reason.value).inc()
        if request.reply_to:
            await self._ctx.nc.publish(request.reply_to, outcome.to_json())
        return ACK


async def open_request_ids(ctx: WorkerContext) -> KeyValue:
    bucket = ctx.ns.stream(REQUEST_IDS_BUCKET)
    config = KeyValueConfig(
        bucket=bucket,
        history=1,
        ttl=REQUEST_ID_TTL_S,
        storage=StorageType.FILE,
        replicas=ctx.settings.bus.replicas,
    )
    try:
        return await ctx.js.key_value(bucket)
    except Exception:
        return await ctx.js.create_key_value(config)


async def run(ctx: WorkerContext) -> None:
    conductor = Conductor(ctx, await open_request_ids(ctx))
    consumer = PullConsumer(ctx.nc, ctx.js, SUBMITTED, ctx.settings.bus, ctx.ns)
    await consumer.run(per_message(conductor.handle, "admit"), ctx.stop)


async def main(settings: Settings, instance_id: str | None = None) -> None:
    async with worker_context(settings, "conductor", instance_id) as ctx:
        await run(ctx)


if __name__ == "__main__":
    from mooncake.config import load_settings

    s = load_settings()
    configure_logging(s.log_level)
    asyncio.run(main(s))

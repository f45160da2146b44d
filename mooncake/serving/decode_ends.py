"""How a request leaves a decode instance: completed, stopped, failed, or handed back.

Ends go through `serving.ending.Ender` (claim → terminal event → final chunk): the final
chunk goes through the instance's token streamer, after the request's queued token copies.
Then the work message is settled through the bus layer (`PullConsumer.settle`: ack, or nak
with backoff) and the request's tail object, which belongs to it alone, is removed.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Literal

from opentelemetry import trace

from mooncake import events as ev
from mooncake import metrics
from mooncake.bus.consume import ACK, PullConsumer, Retry
from mooncake.bus.heartbeat import Heartbeats
from mooncake.serving.decode_jobs import Job
from mooncake.serving.ending import Ender, Terminal, final, observe_completed
from mooncake.serving.prefill_kv import remove_tail
from mooncake.serving.streaming import TokenStreamer
from mooncake.store.client import StoreClient
from mooncake.work import TokenChunk, completed_event_id

log = logging.getLogger("mooncake.decode")

ROLE = "decode"
# Why a job stops that make the request end cancelled (`Job.stop`).
CANCELLATIONS = ("client", "ended:cancelled", "deadline")


def slowest_tenth_mean(times: list[float]) -> float | None:
    """TBT as FAST'25 scores it: the mean of the slowest 10 % of inter-token gaps."""
    gaps = sorted((b - a for a, b in itertools.pairwise(times)), reverse=True)
    if not gaps:
        return None
    worst = gaps[: max(1, len(gaps) // 10)]
    return sum(worst) / len(worst)


class DecodeEnds:
    def __init__(
        self,
        ender: Ender,
        streamer: TokenStreamer,
        store: StoreClient,
        consumer: PullConsumer,
        heartbeats: Heartbeats,
        max_deliver: int,
    ) -> None:
        self.ender, self.streamer, self.store = ender, streamer, store
        self.consumer, self.heartbeats, self.max_deliver = consumer, heartbeats, max_deliver

    async def complete(self, job: Job, tokens: list[int], text: str, reason: str) -> None:
        w = job.work
        finish: Literal["stop", "length"] = "length" if reason == "length" else "stop"
        ttft = max(w.first_token_at - w.timing.submitted_at, 0.0)
        tbt = slowest_tenth_mean(job.times)
        event = ev.RequestCompleted(
            event_id=completed_event_id(w.admitted_event_id, "decode"),
            request_id=w.request_id, output_tokens=len(tokens), finish_reason=finish,
            ttft_s=ttft, tbt_s=tbt, text=text or None,
        )  # fmt: skip
        last = final(w.request_id, max(len(tokens), 1), finish, text=job.texts.rest(text))
        job.span.set_attribute("mc.output_tokens", len(tokens))
        await self._end(job, event, last, lambda: observe_completed(ROLE, finish, ttft, tbt))

    async def stopped(self, job: Job) -> None:
        """Cancelled by the client, past its deadline, or ended by another instance."""
        w, why = job.work, job.stop or ""
        job.span.set_attribute("mc.stopped", why)
        if why in CANCELLATIONS:
            await self._stopped_fact(job, why)
        if why == "deadline":
            event_id = ev.derived_event_id(w.admitted_event_id, "decode.cancelled")
            event = ev.RequestCancelled(
                event_id=event_id, request_id=w.request_id, reason="deadline", stage="decode"
            )
            last = final(w.request_id, max(job.sent, 1), "cancelled")
            count = metrics.REQUESTS_ENDED.labels("cancelled", ROLE, "deadline").inc
            await self._end(job, event, last, count)
            return
        try:
            with trace.use_span(job.span, end_on_exit=False):
                if why in ("client", "ended:cancelled"):  # the Conductor ended it; tell ours
                    await self.streamer.close(final(w.request_id, max(job.sent, 1), "cancelled"))
                else:
                    self.streamer.discard(w.request_id)
            log.info("%s: stopped (%s) after %d tokens", w.request_id, why, job.sent)
            await self._settled(job)
        except Exception as exc:
            log.exception("%s: stopping failed", w.request_id)
            job.span.record_exception(exc)
            job.span.end()

    async def _stopped_fact(self, job: Job, why: str) -> None:
        """How many tokens the cancelled request's client got (the record's output_tokens;
        whoever publishes the cancellation may not know). Best effort: the end goes on."""
        w = job.work
        event = ev.DecodeStopped(
            event_id=ev.derived_event_id(w.admitted_event_id, f"decode.stopped-{w.attempt}"),
            request_id=w.request_id, instance=w.decode_instance, attempt=w.attempt,
            reason=why[:64], output_tokens=job.sent,
        )  # fmt: skip
        try:
            await self.ender.publisher.publish(event)
        except Exception as exc:
            log.warning("%s: stop not recorded: %s", w.request_id, exc)

    async def fail(self, job: Job, reason: str, detail: str) -> None:
        w = job.work
        event = ev.RequestFailed(
            event_id=ev.derived_event_id(w.admitted_event_id, "decode.failed"),
            request_id=w.request_id, reason=reason, stage="decode", detail=detail[:2000],
        )  # fmt: skip
        last = final(w.request_id, max(job.sent, 1), "failed", f"{reason}: {detail}"[:2000])
        job.span.set_attribute("mc.failed", reason)
        if w.request_id not in self.streamer:
            self.streamer.open(w.request_id, w.reply_to)
        count = metrics.REQUESTS_ENDED.labels("failed", ROLE, reason).inc
        await self._end(job, event, last, count)

    async def hand_back(self, job: Job, exc: BaseException) -> None:
        """A transient failure (the bus, the bucket, a failed step): redeliver it later, or
        fail it once its deliveries are spent (never an endless loop, never a silent drop)."""
        if job.delivery.num_delivered >= self.max_deliver:
            await self.fail(job, "retries_exhausted", f"{type(exc).__name__}: {exc}")
            return
        job.span.record_exception(exc)
        self.streamer.discard(job.rid)
        self.heartbeats.drop(job.delivery)
        try:
            await self.consumer.settle(job.delivery, Retry(f"{type(exc).__name__}: {exc}"))
        finally:
            job.span.end()

    async def quietly(self, job: Job) -> None:
        """Ended elsewhere before it started here: settle it, nothing to say."""
        self.streamer.discard(job.rid)
        await self._settled(job)

    async def _end(
        self, job: Job, event: Terminal, last: TokenChunk, count: Callable[[], None]
    ) -> None:
        try:
            with trace.use_span(job.span, end_on_exit=False):
                if await self.ender.end(event, last, send=self.streamer.close):
                    count()
                else:
                    log.info("%s: ended elsewhere before it ended here", job.rid)
                    self.streamer.discard(job.rid)
            await self._settled(job)
        except Exception as exc:
            # Not settled: the message is redelivered and the same claim wins again.
            log.exception("%s: ending it failed", job.rid)
            job.span.record_exception(exc)
            self.streamer.discard(job.rid)
            job.span.end()

    async def _settled(self, job: Job) -> None:
        self.heartbeats.drop(job.delivery)
        try:
            await self.consumer.settle(job.delivery, ACK)
        finally:
            job.span.end()
        await remove_tail(self.store, job.work.request_id, job.work.tail_key)

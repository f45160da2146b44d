"""The decode worker: continuous batching over KV prefilled elsewhere, tokens streamed out.

One instance consumes `mc.decode.<instance>` (stream MC_WORK, durable `decode-<instance>`)
through the bus layer's flow-controlled intake (`PullConsumer.feed`): it asks for work only
while its batch has room and nothing waits for KV pages, so work it cannot hold yet waits on
its queue, where the Conductor sees it. Each `DecodeWork` message is held (heartbeated) until
its request ends here, so a worker that dies leaves its work for redelivery.

What happens to a request in between is `mooncake.serving.decode_loop` (admission by KV
pages, loading the prompt's KV into the engine's pool, the batch, preemption and resumption,
streaming) and `decode_ends` (completed, stopped, failed, handed back: through the one
`Ender`). This module wires them to the bus: intake, cancellations, the terminal-slot
reconciliation, and load reports (the pool's capacity and free pages, which the Conductor's
decode fit uses).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Final

from nats.aio.msg import Msg
from nats.js.kv import KeyValue
from opentelemetry import trace
from opentelemetry.trace import SpanKind
from pydantic import ValidationError

from mooncake import events as ev
from mooncake import metrics
from mooncake.aio import cancel_all
from mooncake.bus import terminal
from mooncake.bus.consume import ConsumerSpec, DeadLetter, Delivery, PullConsumer
from mooncake.bus.heartbeat import Heartbeats
from mooncake.config import Settings
from mooncake.engine import DecodeBatch, Engine, compute
from mooncake.serving.decode_ends import DecodeEnds
from mooncake.serving.decode_jobs import Job, Jobs
from mooncake.serving.decode_loop import DecodeLoop
from mooncake.serving.ending import Ender
from mooncake.serving.engine_tier import EngineTier
from mooncake.serving.local_store import LocalStore, cluster_secret, local_store
from mooncake.serving.models import build_engine, calibrate_engine, warm_decode
from mooncake.serving.streaming import TextDeltas, TokenStreamer
from mooncake.telemetry import extract_context, tracer
from mooncake.work import (
    DecodeWork,
    EngineTiming,
    LoadReport,
    TokenChunk,
    WorkSubjects,
    completed_event_id,
)
from workers.runtime import WorkerContext, configure_logging, worker_context

log = logging.getLogger("mooncake.decode")

ROLE: Final = "decode"
LOAD_EVERY_S = 0.25
RECONCILE_EVERY_S = 1.0  # look up the terminal slot of every held request this often


def work_spec(instance: str) -> ConsumerSpec:
    return ConsumerSpec("MC_WORK", f"decode-{instance}", f"mc.decode.{instance}")


class DecodeWorker:
    def __init__(
        self, ctx: WorkerContext, engine: Engine, store: LocalStore, terminal_kv: KeyValue
    ) -> None:
        self.ctx, self.engine, self.store, self.kv = ctx, engine, store, terminal_kv
        s = ctx.settings
        self.instance = ctx.instance_id
        self.subjects = WorkSubjects(ctx.ns)
        self.streamer = TokenStreamer(ctx.nc, ctx.js, ctx.ns, instance=self.instance)
        self.jobs = Jobs()
        self._consumer = PullConsumer(ctx.nc, ctx.js, work_spec(self.instance), s.bus, ctx.ns)
        self.heartbeats = Heartbeats(s.bus.ack_wait_s / 3)
        ender = Ender(ctx.nc, ctx.publisher, terminal_kv)
        self.ends = DecodeEnds(
            ender, self.streamer, store.client, self._consumer, self.heartbeats, s.bus.max_deliver
        )
        self.loop = DecodeLoop(
            engine, store.client, self.jobs, self.ends, self.streamer, ctx.publisher,
            self.instance, s.engine.max_batch, self._consumer.wake,
        )  # fmt: skip
        self._load_seq = 0
        self.calibration: list[EngineTiming] = []  # the engine's step timings at start
        self._queued_gauge = metrics.WORKER_QUEUED.labels(ROLE)
        self._running_gauge = metrics.WORKER_RUNNING.labels(ROLE)
        metrics.DECODE_KV_CAPACITY_TOKENS.set(engine.pool.capacity_tokens)
        metrics.SLO_SECONDS.labels("ttft").set(s.slo.ttft_s)  # the lines TTFT/TBT are held to
        metrics.SLO_SECONDS.labels("tbt").set(s.slo.tbt_s)

    @property
    def batch(self) -> DecodeBatch:
        return self.loop.batch

    @batch.setter
    def batch(self, batch: DecodeBatch) -> None:
        self.loop.batch = batch

    @property
    def recomputed(self) -> int:
        return self.loop.recomputed

    # --- the whole worker -------------------------------------------------------------------

    async def run(self) -> None:
        await self._consumer.ensure()  # work sent meanwhile waits in it, not lost
        self.calibration = await calibrate_engine(self.engine, self.ctx.settings, ROLE)
        cancels = await self.ctx.nc.subscribe(self.subjects.cancel(), cb=self._on_cancel)
        side = [
            asyncio.create_task(self._consumer.feed(self._accept, self.loop.pull_room,
                                                    self.ctx.stop, self._exhausted)),
            asyncio.create_task(self.heartbeats.run()),
            asyncio.create_task(self._load_reports()),
            asyncio.create_task(self._reconcile()),
            asyncio.create_task(EngineTier(self.ctx.nc, self.ctx.ns, self.instance,
                                           self.engine.pool.pages).run()),
        ]  # fmt: skip
        pool = self.engine.pool
        log.info(
            "decode %s: max_batch %d, KV pool %d tokens (%d pages of %d), node %s",
            self.instance, self.loop.max_batch, pool.capacity_tokens, pool.pages.total,
            pool.page_tokens, self.store.node_id,
        )  # fmt: skip
        try:
            await self.loop.run(self.ctx.stop)
        finally:
            await cancel_all(side)
            with contextlib.suppress(Exception):
                await cancels.unsubscribe()
            if self.loop.tasks:
                await asyncio.wait(set(self.loop.tasks), timeout=10)
            for job in self.jobs:
                job.span.end()

    # --- intake -----------------------------------------------------------------------------

    def _accept(self, d: Delivery) -> None:
        """A delivery from the intake: booked at once (the intake's room counts it), looked
        at in a task."""
        try:
            work = DecodeWork.model_validate_json(d.data)
        except ValidationError as exc:
            self.loop.spawn(self._consumer.settle(d, DeadLetter("invalid_work", str(exc)[:1000])))
            return
        held = self.jobs.get(work.request_id)
        if held is not None:
            # The same work again (redelivered while we hold it): keep the newest delivery.
            self.heartbeats.drop(held.delivery)
            held.delivery = d
            self.heartbeats.hold(d)
            return
        job = self._new_job(work, d)
        self.jobs.add(job)
        self.heartbeats.hold(d)
        self.loop.spawn(self._receive(job))

    def _exhausted(self, d: Delivery) -> None:
        """Delivered more often than the bus allows (it kept failing, or killed the worker):
        the request fails here, so it still ends; unreadable work is dead-lettered."""
        try:
            work = DecodeWork.model_validate_json(d.data)
        except ValidationError as exc:
            self.loop.spawn(self._consumer.settle(d, DeadLetter("invalid_work", str(exc)[:1000])))
            return
        job = self._new_job(work, d)
        detail = f"delivered {d.num_delivered} times"
        self.loop.spawn(self.ends.fail(job, "retries_exhausted", detail))

    def _new_job(self, work: DecodeWork, d: Delivery) -> Job:
        span = tracer().start_span(
            "decode",
            context=extract_context(d.headers),
            kind=SpanKind.CONSUMER,
            attributes={
                "mc.request_id": work.request_id,
                "mc.instance": self.instance,
                "mc.attempt": work.attempt,
                "mc.prompt_tokens": len(work.token_ids),
            },
        )
        texts = TextDeltas(self.engine.tokenizer, work.params.stop)
        first_text = texts.sent_elsewhere(work.first_token_id)  # prefill sent index 0
        return Job(work, d, texts, span, first_text=first_text)

    async def _receive(self, job: Job) -> None:
        w = job.work
        try:
            redo = completed_event_id(w.admitted_event_id, "decode")
            if (how := await terminal.ended(self.kv, w.request_id, redo=redo)) is not None:
                log.info("%s already %s: skipped", w.request_id, how)
                self.jobs.remove(job)
                self._consumer.wake()
                await self.ends.quietly(job)
                return
            self.streamer.open(w.request_id, w.reply_to)
            first = TokenChunk(
                request_id=w.request_id, index=0, token_ids=[w.first_token_id],
                text=job.first_text,
            )  # fmt: skip
            await self.streamer.emit(first, live=False)  # the replayable copy only
            event_id = ev.derived_event_id(w.admitted_event_id, f"decode.started.{w.attempt}")
            with trace.use_span(job.span, end_on_exit=False):
                await self.ctx.publisher.publish(
                    ev.DecodeStarted(event_id=event_id, request_id=w.request_id,
                                     instance=self.instance, attempt=w.attempt)
                )  # fmt: skip
        except Exception as exc:  # the bus or the bucket did not answer: hand it back
            log.warning("%s: taking decode work failed (%s); retrying it", w.request_id, exc)
            self.jobs.remove(job)
            self._consumer.wake()
            await self.ends.hand_back(job, exc)
            return
        self.jobs.wait(job)
        self.loop.admit()  # now, not at the next step boundary: the intake waits on it
        self.loop.wake.set()

    # --- cancellations, reconciliation, load reports ----------------------------------------

    async def _on_cancel(self, msg: Msg) -> None:
        event = ev.parse_event(msg.data)
        if isinstance(event, ev.CancelRequested):
            job = self.jobs.get(event.request_id)
            if job is not None and job.stop is None:
                job.stop = "client"
                self.loop.wake.set()

    async def _reconcile(self) -> None:
        """Requests ended elsewhere (cancelled while a core-NATS cancel was lost, completed
        by another instance after a redelivery) leave too."""
        while True:
            await asyncio.sleep(RECONCILE_EVERY_S)
            for job in self.jobs:
                if job.stop is not None:
                    continue
                with contextlib.suppress(Exception):
                    redo = completed_event_id(job.work.admitted_event_id, "decode")
                    how = await terminal.ended(self.kv, job.rid, redo=redo)
                    if how is not None and job.stop is None:
                        job.stop = f"ended:{how}"
                        self.loop.wake.set()
            self._consumer.wake()  # pages may have come free: ask for work again

    def load_report(self) -> LoadReport:
        self._load_seq += 1
        pool = self.engine.pool
        running = self.jobs.in_stage("running")
        steps, step_s, step_batch, step_context = self.loop.step_times.take()
        return LoadReport(
            instance=self.instance,
            role="decode",
            node=self.store.node_id,
            seq=self._load_seq,
            at=time.time(),
            queued=len(self.jobs) - len(running),
            running=len(self.batch),
            context_tokens=sum(s.kv.length for s in self.batch.running.values()),
            kv_capacity_tokens=pool.capacity_tokens,
            kv_free_tokens=pool.pages.available * pool.page_tokens,
            kv_page_tokens=pool.page_tokens,
            preemptions=self.loop.preemptions,
            steps=steps,
            step_s=step_s,
            step_batch=step_batch,
            step_context_tokens=step_context,
            calibration=self.calibration,
        )

    async def _load_reports(self) -> None:
        subject = self.subjects.load(self.instance)
        while True:
            report = self.load_report()
            self._queued_gauge.set(report.queued)
            self._running_gauge.set(report.running)
            metrics.DECODE_CONTEXT_TOKENS.set(report.context_tokens)
            metrics.DECODE_KV_FREE_TOKENS.set(report.kv_free_tokens or 0)
            with contextlib.suppress(Exception):
                await self.ctx.nc.publish(subject, report.to_json())
            self._consumer.wake()
            await asyncio.sleep(LOAD_EVERY_S)


async def run(ctx: WorkerContext, engine: Engine | None = None) -> None:
    if engine is None:
        engine = await compute.run(build_engine, ctx.settings, ROLE)
    await compute.run(warm_decode, engine, ctx.settings.engine.max_batch)
    bucket = await terminal.open_bucket(ctx.js, ctx.ns, ctx.settings.bus.replicas)
    async with local_store(ctx.nc, ctx.settings, node_id=ctx.instance_id) as store:
        await DecodeWorker(ctx, engine, store, bucket).run()


async def main(settings: Settings, instance_id: str | None = None) -> None:
    cluster_secret(settings.store)  # a missing secret fails before anything starts
    async with worker_context(settings, ROLE, instance_id) as ctx:
        await run(ctx)


if __name__ == "__main__":
    from mooncake.config import load_settings

    s = load_settings()
    configure_logging(s.log_level)
    asyncio.run(main(s))

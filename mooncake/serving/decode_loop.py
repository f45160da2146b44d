"""One decode instance's batch, driven step by step (decode_jobs has the stages).

Each turn of the loop, between two steps:
1. requests past their deadline or told to stop leave (their pages go back);
2. waiting requests, first in line first, get their pages when `core.kv_admission` says they
   join (their whole context plus the running sequences' growth reserve); their prompt's KV
   starts loading (pool's cache, then the store) while the batch goes on stepping;
3. loaded requests compute what the store could not give and join the batch;
4. one step: every running sequence gets a token. When the pool cannot give a sequence its
   next page, the youngest leave the batch (preempted): each is recorded (`DecodePreempted`,
   a span for the wait), keeps its tokens and goes back in front of the waiting line; when
   pages are free again its KV is reloaded (the prompt's blocks from the pool's cache or the
   store) and recomputed (its output tokens), and it rejoins (`DecodeResumed`). A request is
   never failed for lack of memory.
5. new tokens are streamed; finished requests end (decode_ends).

Compute (steps, recomputation) runs in a worker thread, one thing at a time; store reads run
on the event loop meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from opentelemetry import trace

from mooncake import events as ev
from mooncake import metrics
from mooncake.bus.publish import Publisher
from mooncake.core import kv_admission as ka
from mooncake.engine import Completion, DecodeBatch, Engine, compute
from mooncake.serving import decode_kv
from mooncake.serving.decode_ends import DecodeEnds
from mooncake.serving.decode_jobs import Job, Jobs
from mooncake.serving.models import engine_params
from mooncake.serving.streaming import TokenStreamer
from mooncake.store.client import StoreClient
from mooncake.telemetry import tracer
from mooncake.work import TokenChunk

log = logging.getLogger("mooncake.decode")

DRAIN_S = 10.0  # on shutdown, running sequences get this long to finish
IDLE_WAIT_S = 0.25


class StepTimes:
    """Decode steps since the last load report: the period from one step's start to the
    next (what every running sequence waited for its token), with the batch and KV tokens
    of the step that period served. A step after an idle spell starts a new series."""

    def __init__(self) -> None:
        self._last: tuple[float, int, int] | None = None  # (start, batch, context tokens)
        self.steps = 0
        self._seconds = self._batch = self._context = 0.0

    def started(self, now: float, batch: int, context_tokens: int) -> None:
        if self._last is not None:
            at, b, c = self._last
            self.steps += 1
            self._seconds += now - at
            self._batch += b
            self._context += c
        self._last = (now, batch, context_tokens)

    def idle(self) -> None:
        self._last = None

    def take(self) -> tuple[int, float | None, float | None, float | None]:
        """(steps, mean seconds, mean batch, mean context tokens) since the last take."""
        n = self.steps
        out = (
            (n, self._seconds / n, self._batch / n, self._context / n)
            if n
            else (0, None, None, None)
        )
        self.steps = 0
        self._seconds = self._batch = self._context = 0.0
        return out


class DecodeLoop:
    def __init__(
        self,
        engine: Engine,
        store: StoreClient,
        jobs: Jobs,
        ends: DecodeEnds,
        streamer: TokenStreamer,
        publisher: Publisher,
        instance: str,
        max_batch: int,
        room_changed: Callable[[], None] = lambda: None,
    ) -> None:
        self.engine, self.store, self.jobs, self.ends = engine, store, jobs, ends
        self.streamer, self.publisher = streamer, publisher
        self.instance, self.max_batch = instance, max_batch
        self.room_changed = room_changed  # the intake may ask for more work now
        self.batch = DecodeBatch(engine)
        self.wake = asyncio.Event()
        self.recomputed = 0  # requests whose prompt KV was (partly) recomputed here
        self.preemptions = 0
        self.tasks: set[asyncio.Task[None]] = set()
        self._tokens = metrics.TOKENS_GENERATED.labels("decode")
        self.step_times = StepTimes()  # for the load reports (the Conductor's cost model)

    # --- what admission sees ------------------------------------------------------------

    def pool_state(self) -> ka.PoolState:
        pool = self.engine.pool
        joining = len(self.jobs.in_stage("loading", "ready"))
        return ka.PoolState(
            page_tokens=pool.page_tokens,
            total_pages=pool.pages.total,
            free_pages=pool.pages.available,
            running=len(self.batch) + joining,
            max_batch=self.max_batch,
        )

    def pull_room(self) -> int:
        unadmitted = len(self.jobs.in_stage("receiving", "waiting"))
        return ka.pull_room(self.pool_state(), unadmitted)

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # --- the loop ---------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        drain_until: float | None = None
        while True:
            if stop.is_set():
                drain_until = drain_until or time.monotonic() + DRAIN_S
                if not len(self.batch) or time.monotonic() > drain_until:
                    if len(self.batch):
                        log.warning("shutdown: %d sequences left unfinished", len(self.batch))
                    self._release_held()
                    return
            self._check_deadlines()
            await self._settle_stops()
            if not stop.is_set():
                self.admit()
                await self._join_ready()
            if not len(self.batch):
                self.step_times.idle()
                self.wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), IDLE_WAIT_S)
                continue
            await self._step()

    async def _step(self) -> None:
        running = self.batch.running.values()
        self.step_times.started(
            time.monotonic(), len(self.batch), sum(seq.kv.length for seq in running)
        )
        try:
            finished = await compute.run(self.batch.step)
        except Exception as exc:
            self._step_failed(exc)
            return
        await self._preempted()
        await self._stream_new_tokens()
        for c in finished:
            await self._finished(c)
        await self.streamer.flush_due()

    # --- admission by pages, loading, joining ---------------------------------------------

    def admit(self) -> None:
        """Waiting requests, in order, get their pages while admission says they join (also
        called as work arrives, while a step runs: the pool's counts are thread-safe, and
        the intake asks for the next message as soon as this one has its pages)."""
        while self.jobs.waiting:
            job = self.jobs.waiting[0]
            if job.stop is not None:
                self.jobs.waiting.popleft()
                job.stage = "ready"  # nothing held: `_settle_stops` ends it
                continue
            p = decode_kv.start(self.engine, job.work)
            verdict = ka.admit(self.pool_state(), job.context, p.held_pages)
            if verdict is ka.Verdict.NEVER:
                p.kv.release()
                self.jobs.waiting.popleft()
                self.jobs.remove(job)
                detail = f"{job.context} tokens of KV exceed this instance's whole pool"
                self.spawn(self.ends.fail(job, "kv_capacity", detail))
                continue
            if verdict is not ka.Verdict.JOIN or not p.kv.reserve(job.context + 1):
                p.kv.release()
                return  # first in line waits: no overtaking
            self.jobs.waiting.popleft()
            job.prompt, job.stage = p, "loading"
            job.load = asyncio.create_task(self._load(job))
            self.room_changed()

    async def _load(self, job: Job) -> None:
        assert job.prompt is not None
        await decode_kv.load(self.engine, self.store, job.work, job.prompt)
        job.stage = "ready"
        self.wake.set()

    async def _join_ready(self) -> None:
        for job in self.jobs.in_stage("ready"):
            if job.stop is not None or job.prompt is None:
                continue
            try:
                await self._join(job)
            except Exception as exc:
                log.warning("%s: cannot decode: %s", job.rid, exc)
                job.release()
                self.jobs.remove(job)
                self.spawn(self.ends.fail(job, "decode_error", str(exc)))

    async def _join(self, job: Job) -> None:
        p, w = job.prompt, job.work
        assert p is not None
        computed = await compute.run(decode_kv.compute, self.engine, w, p, job.output)
        if p.missing is not None:
            self._count_recompute(job, p.missing)
        job.prompt, params = None, engine_params(w.params)
        if job.preempted_at is None:
            args = (w.request_id, p.kv, list(w.token_ids), w.first_token_id, params)
            done = await compute.run(self.batch.resume, *args)
        else:
            self.batch.rejoin(w.request_id, p.kv, len(w.token_ids), job.output, params)
            await self._resumed(job, p.loaded_tokens, computed)
            done = None
        job.stage = "running"
        if done is not None:
            await self._finished(done)

    def _count_recompute(self, job: Job, why: str) -> None:
        log.info("%s: prompt KV not in the store (%s): recomputed here", job.rid, why)
        metrics.DECODE_KV_RECOMPUTED.labels(why).inc()
        self.recomputed += 1
        job.span.set_attribute("mc.kv_recomputed", why)

    # --- preemption ----------------------------------------------------------------------------

    async def _preempted(self) -> None:
        for taken in self.batch.take_preempted():
            job = self.jobs.get(taken.id)
            if job is None:
                continue
            job.output, job.preemptions = list(taken.output), job.preemptions + 1
            job.preempted_at = time.monotonic()
            self.preemptions += 1
            metrics.DECODE_PREEMPTIONS.inc()
            self.jobs.wait(job, first=True)
            ctx = trace.set_span_in_context(job.span)
            job.preempted_span = tracer().start_span(
                "decode preempted",
                context=ctx,
                attributes={"mc.request_id": job.rid, "mc.preemption": job.preemptions,
                            "mc.output_tokens": len(job.output)},
            )  # fmt: skip
            w = job.work
            log.info("%s: preempted for KV pages after %d tokens", job.rid, len(job.output))
            await self._publish(
                ev.DecodePreempted(
                    event_id=self._event_id(job, "preempted"), request_id=w.request_id,
                    instance=self.instance, attempt=w.attempt, preemption=job.preemptions,
                    output_tokens=len(job.output), context_tokens=job.context,
                ),
                job,
            )  # fmt: skip

    async def _resumed(self, job: Job, reloaded: int, computed: int) -> None:
        w = job.work
        waited = time.monotonic() - (job.preempted_at or time.monotonic())
        if job.preempted_span is not None:
            job.preempted_span.set_attribute("mc.reloaded_tokens", reloaded)
            job.preempted_span.set_attribute("mc.recomputed_tokens", computed)
            job.preempted_span.end()
            job.preempted_span = None
        job.preempted_at = None
        await self._publish(
            ev.DecodeResumed(
                event_id=self._event_id(job, "resumed"), request_id=w.request_id,
                instance=self.instance, attempt=w.attempt, preemption=job.preemptions,
                reloaded_tokens=reloaded, recomputed_tokens=computed, waited_s=waited,
            ),
            job,
        )  # fmt: skip

    @staticmethod
    def _event_id(job: Job, kind: str) -> str:
        w = job.work
        return ev.derived_event_id(
            w.admitted_event_id, f"decode.{kind}.{w.attempt}.{job.preemptions}"
        )

    async def _publish(self, event: ev.Event, job: Job) -> None:
        """A fact of the record; one that cannot be published now is logged, never fatal
        (the request goes on either way)."""
        try:
            with trace.use_span(job.span, end_on_exit=False):
                await self.publisher.publish(event)
        except Exception as exc:
            log.warning("%s: %s not published: %s", job.rid, event.type, exc)

    # --- tokens and ends -----------------------------------------------------------------------

    async def _stream_new_tokens(self) -> None:
        now = time.monotonic()
        for rid, seq in list(self.batch.running.items()):
            job = self.jobs.get(rid)
            if job is not None:
                await self.emit(job, seq.output, now)

    async def emit(self, job: Job, output: list[int], now: float) -> None:
        """Stream the tokens of `output` not streamed yet (one chunk per token)."""
        for i in range(job.sent, len(output)):
            token = output[i]
            chunk = TokenChunk(
                request_id=job.rid, index=i, token_ids=[token], text=job.texts.push(token)
            )
            job.times.append(now)
            job.sent = i + 1
            self._tokens.inc()
            try:
                await self.streamer.emit(chunk)
            except Exception as exc:  # a client subject we cannot publish to: keep decoding
                log.debug("%s: chunk %d not sent: %s", job.rid, i, exc)

    async def _finished(self, c: Completion) -> None:
        job = self.jobs.get(c.id)
        if job is None:
            return
        await self.emit(job, c.tokens, time.monotonic())
        self.jobs.remove(job)
        self.room_changed()
        self.spawn(self.ends.complete(job, c.tokens, c.text, c.finish_reason))

    def _check_deadlines(self) -> None:
        now = time.time()
        for job in self.jobs:
            deadline = job.work.timing.deadline_at
            if job.stop is None and deadline is not None and now > deadline:
                job.stop = "deadline"

    async def _settle_stops(self) -> None:
        for job in self.jobs:
            if job.stop is None or job.stage == "receiving":
                continue
            if job.stage == "running":
                with contextlib.suppress(Exception):
                    self.batch.cancel(job.rid)
            if job.load is not None and not job.load.done():
                job.load.cancel()  # its pages are written no more once it is done
                await asyncio.gather(job.load, return_exceptions=True)
            self._leave(job)
            self.spawn(self.ends.stopped(job))

    def _leave(self, job: Job) -> None:
        self.room_changed()
        job.release()
        if job.preempted_span is not None:
            job.preempted_span.end()
            job.preempted_span = None
        self.jobs.remove(job)

    def _step_failed(self, exc: Exception) -> None:
        """A step that raised leaves the batch in an unknown state: every running sequence
        gives its pages back and is handed back for redelivery (its retry budget ends it if
        this keeps happening)."""
        log.exception("decode step failed: %d sequences handed back", len(self.batch))
        for seq in list(self.batch.running.values()):
            seq.kv.release()
        running = [j for rid in list(self.batch.running) if (j := self.jobs.get(rid))]
        self.batch = DecodeBatch(self.engine)
        for job in running:
            self._leave(job)
            self.spawn(self.ends.hand_back(job, exc))

    def _release_held(self) -> None:
        """Shutdown: jobs not running give their pages back (their messages stay unacked and
        are redelivered)."""
        for job in self.jobs.in_stage("waiting", "loading", "ready"):
            if job.load is not None:
                job.load.cancel()
            job.release()

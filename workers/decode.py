"""The decode worker: continuous batching over KV prefilled elsewhere, tokens streamed out.

One instance consumes `mc.decode.<instance>` (stream MC_WORK, durable `decode-<instance>`).
For each `DecodeWork` it reads the prompt's KV from the store (the whole blocks under their
chained keys and the request's partial tail block), joins the running batch with the first
token that prefill already sampled and streamed (index 0), and streams every later token to
the client as it is decoded (`mooncake.serving.streaming`). When a sequence finishes, the
worker claims the request's terminal slot (`bus.terminal`); only the winner publishes
`RequestCompleted` and the final chunk. The message is acked when the request has ended, so
a worker that dies leaves its work pending for the Conductor to re-dispatch.

Concurrency: the engine runs in a worker thread, one step at a time, driven by the decode
loop; between steps the loop lets new sequences join and stopped ones leave. The event loop
meanwhile pulls work (only while there is room: `max_batch` sequences and
`kv_capacity_tokens` KV tokens, counting each sequence at its largest possible size),
loads KV, heartbeats every held message, publishes load reports, and hears cancellations.

A KV object that is missing (evicted, its node lost) is not an error: the worker recomputes
the prompt's KV with a local prefill (logged and counted), which costs one prefill's time
for the whole batch but gives the same tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from nats.aio.msg import Msg
from nats.js.kv import KeyValue
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind
from pydantic import ValidationError

from mooncake import events as ev
from mooncake import metrics
from mooncake.aio import cancel_all
from mooncake.bus import terminal
from mooncake.bus.consume import ConsumerSpec, PullConsumer
from mooncake.bus.publish import MSG_ID
from mooncake.config import Settings
from mooncake.engine import Completion, DecodeBatch, Engine, EngineError, PagedKV
from mooncake.serving.local_store import LocalStore, cluster_secret, local_store
from mooncake.serving.models import build_engine, engine_params
from mooncake.serving.streaming import TextDeltas, TokenStreamer
from mooncake.telemetry import extract_context, tracer
from mooncake.work import DecodeWork, LoadReport, TokenChunk, WorkSubjects
from workers.runtime import WorkerContext, configure_logging, worker_context

log = logging.getLogger("mooncake.decode")

ROLE = "decode"
LOAD_EVERY_S = 0.25
RECONCILE_EVERY_S = 1.0  # look up the terminal slot of every running request this often
PULL_EXPIRES_S = 2.0
DRAIN_S = 10.0  # on shutdown, running sequences get this long to finish


def work_spec(instance: str) -> ConsumerSpec:
    return ConsumerSpec("MC_WORK", f"decode-{instance}", f"mc.decode.{instance}")


def _backoff(msg: Msg) -> float:
    return float(min(0.2 * 2 ** max(int(msg.metadata.num_delivered) - 1, 0), 10.0))


def slowest_tenth_mean(times: list[float]) -> float | None:
    """TBT as FAST'25 scores it: the mean of the slowest 10 % of inter-token gaps."""
    gaps = sorted((b - a for a, b in itertools.pairwise(times)), reverse=True)
    if not gaps:
        return None
    worst = gaps[: max(1, len(gaps) // 10)]
    return sum(worst) / len(worst)


def observe_completed(finish_reason: str, ttft_s: float, tbt_s: float | None) -> None:
    """A request this worker completed (it won the terminal claim: counted once)."""
    metrics.REQUESTS_ENDED.labels("completed", ROLE, finish_reason).inc()
    metrics.TTFT_SECONDS.observe(ttft_s)
    if tbt_s is not None:  # a single decoded token has no gap to score
        metrics.TBT_SECONDS.observe(tbt_s)


# --- the prompt's KV from the store ---------------------------------------------------------


def kv_from_objects(engine: Engine, objects: list[tuple[torch.Tensor, int]]) -> PagedKV:
    """A sequence KV in the engine's pool from block objects read into uint8 tensors, each
    (bytes, tokens); the headers must say exactly this model's layout (EngineError
    otherwise)."""
    layout = engine.layout
    return engine.prefix_from_blocks([layout.payload(raw, tokens) for raw, tokens in objects])


async def load_prompt_kv(engine: Engine, store: LocalStore, work: DecodeWork) -> PagedKV | str:
    """The prompt's KV from the store, or why it cannot be had (then it is recomputed)."""
    bt = engine.block_tokens
    tail = work.tail_tokens if work.tail_key else 0
    if len(work.kv_keys) * bt + tail != len(work.token_ids):
        return "no_kv"  # the work names no (or not all) KV: compute it here
    keys = list(work.kv_keys) + ([work.tail_key] if work.tail_key and tail else [])
    whole = torch.empty((len(work.kv_keys), engine.layout.object_size(bt)), dtype=torch.uint8)
    bufs: list[torch.Tensor] = [whole[i] for i in range(len(work.kv_keys))]
    if len(keys) > len(bufs):
        bufs.append(torch.empty(engine.layout.object_size(tail), dtype=torch.uint8))
    try:
        sizes = await store.client.get_many_into(keys, bufs)
    except Exception as exc:  # the master did not answer, a transport failed, ...
        log.warning("%s: KV read failed (%s)", work.request_id, exc)
        return "store_error"
    if any(n != len(b) for n, b in zip(sizes, bufs, strict=True)):
        return "miss"
    objects = [(b, bt) for b in bufs[: len(work.kv_keys)]]
    if tail:
        objects.append((bufs[-1], tail))
    try:
        return await asyncio.to_thread(kv_from_objects, engine, objects)
    except EngineError as exc:
        log.warning("%s: KV objects unusable (%s)", work.request_id, exc)
        return "bad_object"


# --- one request in this worker ----------------------------------------------------------------


Stage = Literal["loading", "ready", "running"]


@dataclass
class Job:
    work: DecodeWork
    msg: Msg
    footprint: int  # KV tokens it may come to hold (what flow control counts)
    texts: TextDeltas
    span: Span
    stage: Stage = "loading"
    kv: PagedKV | str | None = None  # the loaded KV, or why there is none
    sent: int = 1  # next output index to stream (index 0 came from prefill)
    times: list[float] = field(default_factory=list)  # monotonic time of each token here
    stop: str | None = None  # why it must leave early: client | deadline | ended:<how>
    first_text: str = ""  # the text of index 0 (streamed by prefill)

    @property
    def rid(self) -> str:
        return self.work.request_id


class DecodeWorker:
    def __init__(
        self, ctx: WorkerContext, engine: Engine, store: LocalStore, terminal_kv: KeyValue
    ) -> None:
        self.ctx, self.engine, self.store, self.kv = ctx, engine, store, terminal_kv
        s = ctx.settings
        self.max_batch = s.engine.max_batch
        self.capacity = engine.pool.capacity_tokens
        self.instance = ctx.instance_id
        self.subjects = WorkSubjects(ctx.ns)
        self.streamer = TokenStreamer(ctx.nc, ctx.js, ctx.ns)
        self.batch = DecodeBatch(engine)
        self.jobs: dict[str, Job] = {}
        self.ready: deque[Job] = deque()
        self.recomputed = 0  # prompts whose KV was recomputed here (tests, logs)
        self._wake = asyncio.Event()  # the decode loop has something to do
        self._room = asyncio.Event()  # the intake may pull more
        self._tasks: set[asyncio.Task[None]] = set()
        self._outstanding = 0  # messages our open pull requests may still deliver
        self._arriving = 0  # delivered, not yet on the books (or settled)
        self._last_pull = 0.0
        self._load_seq = 0
        self._consumer = PullConsumer(ctx.nc, ctx.js, work_spec(self.instance), s.bus, ctx.ns)
        self._done = asyncio.Event()  # the decode loop has drained
        self._tokens = metrics.TOKENS_GENERATED.labels(ROLE)
        self._queued_gauge = metrics.WORKER_QUEUED.labels(ROLE)
        self._running_gauge = metrics.WORKER_RUNNING.labels(ROLE)
        metrics.DECODE_KV_CAPACITY_TOKENS.set(self.capacity)
        metrics.SLO_SECONDS.labels("ttft").set(s.slo.ttft_s)  # the lines TTFT/TBT are held to
        metrics.SLO_SECONDS.labels("tbt").set(s.slo.tbt_s)

    # --- accounting -------------------------------------------------------------------------

    @property
    def reserved_tokens(self) -> int:
        return sum(j.footprint for j in self.jobs.values())

    def _running(self) -> list[Job]:
        return [j for j in self.jobs.values() if j.stage == "running"]

    @property
    def context_tokens(self) -> int:
        """KV tokens the running sequences hold (from our books: a step may be running)."""
        return sum(len(j.work.token_ids) + j.sent for j in self._running())

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _kick(self) -> None:
        self._wake.set()
        self._room.set()

    # --- the whole worker -------------------------------------------------------------------

    async def run(self) -> None:
        await self._consumer.ensure()
        nc = self.ctx.nc
        inbox = nc.new_inbox()
        pulls = await nc.subscribe(
            inbox, cb=self._on_delivery, pending_msgs_limit=-1, pending_bytes_limit=-1
        )
        cancels = await nc.subscribe(self.subjects.cancel(), cb=self._on_cancel)
        side = [
            asyncio.create_task(self._intake(inbox)),
            asyncio.create_task(self._heartbeats()),
            asyncio.create_task(self._load_reports()),
            asyncio.create_task(self._reconcile()),
        ]
        log.info(
            "decode %s: max_batch %d, kv capacity %d tokens, node %s",
            self.instance,
            self.max_batch,
            self.capacity,
            self.store.node_id,
        )
        try:
            await self._decode_loop()
        finally:
            await cancel_all(side)
            with contextlib.suppress(Exception):
                await pulls.unsubscribe()
            with contextlib.suppress(Exception):
                await cancels.unsubscribe()
            if self._tasks:
                await asyncio.wait(set(self._tasks), timeout=10)
            for job in self.jobs.values():
                job.span.end()

    # --- intake: pull only while there is room ------------------------------------------------

    def _free(self) -> int:
        if self.ctx.stop.is_set() or self.reserved_tokens >= self.capacity:
            return 0
        return self.max_batch - len(self.jobs) - self._arriving - self._outstanding

    async def _intake(self, inbox: str) -> None:
        stream, durable = self._consumer.spec.stream, self._consumer.spec.durable
        subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}"
        while not self.ctx.stop.is_set():
            now = time.monotonic()
            if self._outstanding and now - self._last_pull > PULL_EXPIRES_S + 1.0:
                self._outstanding = 0  # every request we made has expired (or was lost)
            want = self._free()
            if want > 0:
                request = {"batch": want, "expires": int(PULL_EXPIRES_S * 1e9)}
                try:
                    await self.ctx.nc.publish(subject, json.dumps(request).encode(), reply=inbox)
                    self._outstanding += want
                    self._last_pull = now
                except Exception as exc:  # disconnected: the next turn tries again
                    log.debug("pull request failed: %s", exc)
            self._room.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._room.wait(), PULL_EXPIRES_S / 2)

    async def _on_delivery(self, msg: Msg) -> None:
        status = (msg.headers or {}).get("Status")
        if status is None and msg.reply:
            self._outstanding = max(self._outstanding - 1, 0)
            self._arriving += 1
            self._spawn(self._receive(msg))
        elif status in ("404", "408"):
            pending = (msg.headers or {}).get("Nats-Pending-Messages")
            self._outstanding = max(self._outstanding - (int(pending) if pending else 0), 0)
            self._room.set()
        elif status == "409":
            self._outstanding = 0
            self._room.set()

    async def _receive(self, msg: Msg) -> None:
        try:
            await self._receive_one(msg)
        finally:
            self._arriving -= 1
            self._room.set()

    async def _receive_one(self, msg: Msg) -> None:
        try:
            work = DecodeWork.model_validate_json(msg.data)
        except ValidationError as exc:
            await self._dead_letter(msg, "invalid_work", str(exc)[:1000])
            return
        try:
            await self._take(work, msg)
        except Exception:
            # Transient (the bus or the bucket did not answer): hand it back for later.
            log.exception("%s: taking decode work failed; retrying it", work.request_id)
            job = self.jobs.get(work.request_id)
            if job is not None and job.msg is msg:
                self._drop(job)
                job.span.end()
                self.streamer.discard(work.request_id)
            with contextlib.suppress(Exception):
                await msg.nak(delay=_backoff(msg))

    async def _take(self, work: DecodeWork, msg: Msg) -> None:
        delivered = int(msg.metadata.num_delivered)
        if (held := self.jobs.get(work.request_id)) is not None:
            # The same work again (redelivered while we hold it): keep the newest delivery.
            held.msg = msg
            return
        if delivered > self.ctx.settings.bus.max_deliver:
            await self._fail_work(work, msg, "retry_budget", f"delivered {delivered} times")
            return
        if (how := await terminal.ended(self.kv, work.request_id)) is not None:
            log.info("%s already %s: skipped", work.request_id, how)
            await self._end_quietly(work, msg)
            return
        job = self._new_job(work, msg)
        self.jobs[work.request_id] = job
        first = TokenChunk(
            request_id=work.request_id,
            index=0,
            token_ids=[work.first_token_id],
            text=job.first_text,
        )
        await self.streamer.emit(first, live=False)  # the replayable copy only
        with trace.use_span(job.span, end_on_exit=False):
            await self.ctx.publisher.publish(
                ev.DecodeStarted(
                    event_id=ev.derived_event_id(
                        work.admitted_event_id, f"decode.started.{work.attempt}"
                    ),
                    request_id=work.request_id,
                    instance=self.instance,
                    attempt=work.attempt,
                )
            )
        job.kv = await load_prompt_kv(self.engine, self.store, work)
        job.stage = "ready"
        self.ready.append(job)
        self._wake.set()

    def _new_job(self, work: DecodeWork, msg: Msg) -> Job:
        footprint = min(len(work.token_ids) + work.params.max_tokens, self.engine.spec.context)
        span = tracer().start_span(
            "decode",
            context=extract_context(msg.headers),
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
        self.streamer.open(work.request_id, work.reply_to)
        return Job(work, msg, footprint, texts, span, first_text=first_text)

    # --- the decode loop --------------------------------------------------------------------

    async def _decode_loop(self) -> None:
        drain_until: float | None = None
        while True:
            if self.ctx.stop.is_set():
                drain_until = drain_until or time.monotonic() + DRAIN_S
                if not len(self.batch) or time.monotonic() > drain_until:
                    if len(self.batch):
                        log.warning("shutdown: %d sequences left unfinished", len(self.batch))
                    return
            self._check_deadlines()
            self._settle_stops()
            if not self.ctx.stop.is_set():
                await self._join_ready()
            if not len(self.batch):
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), 0.25)
                continue
            try:
                finished = await asyncio.to_thread(self.batch.step)
            except Exception as exc:
                self._step_failed(exc)
                continue
            await self._stream_new_tokens()
            for c in finished:
                await self._finished(c)
            await self.streamer.flush_due()

    def _check_deadlines(self) -> None:
        now = time.time()
        for job in self.jobs.values():
            deadline = job.work.timing.deadline_at
            if job.stop is None and deadline is not None and now > deadline:
                job.stop = "deadline"

    async def _join_ready(self) -> None:
        while self.ready and len(self.batch) < self.max_batch:
            job = self.ready[0]
            if job.stop is None and len(self.batch) and not self._fits(job):
                return  # wait for room (FIFO: no overtaking)
            self.ready.popleft()
            if job.stop is not None:
                continue  # settled with the other stopped jobs
            try:
                kv = job.kv if isinstance(job.kv, PagedKV) else await self._recompute(job)
                job.kv = None
                params = engine_params(job.work.params)
                w = job.work
                done = await asyncio.to_thread(
                    self.batch.resume, w.request_id, kv, list(w.token_ids), w.first_token_id, params
                )
            except Exception as exc:
                log.warning("%s: cannot decode: %s", job.rid, exc)
                self._drop(job)
                self._spawn(self._fail_work(job.work, job.msg, "decode_error", str(exc), job))
                continue
            job.stage = "running"
            if done is not None:
                await self._finished(done)

    def _fits(self, job: Job) -> bool:
        running = sum(j.footprint for j in self.jobs.values() if j.stage == "running")
        return running + job.footprint <= self.capacity

    async def _recompute(self, job: Job) -> PagedKV:
        why = job.kv if isinstance(job.kv, str) else "miss"
        log.info("%s: prompt KV not in the store (%s): recomputing it here", job.rid, why)
        metrics.DECODE_KV_RECOMPUTED.labels(why).inc()
        self.recomputed += 1
        job.span.set_attribute("mc.kv_recomputed", why)
        prefilled = await asyncio.to_thread(self.engine.prefill, list(job.work.token_ids))
        return prefilled.kv

    async def _stream_new_tokens(self) -> None:
        now = time.monotonic()
        for rid, seq in list(self.batch.running.items()):
            job = self.jobs.get(rid)
            if job is not None:
                await self._emit(job, seq.output, now)

    async def _emit(self, job: Job, output: list[int], now: float) -> None:
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
        await self._emit(job, c.tokens, time.monotonic())
        self._drop(job)
        self._spawn(self._complete(job, c))

    def _drop(self, job: Job) -> None:
        """The job leaves this worker's books (its message is settled by the caller)."""
        self.jobs.pop(job.rid, None)
        with contextlib.suppress(ValueError):
            self.ready.remove(job)
        self._room.set()

    def _settle_stops(self) -> None:
        for job in [j for j in self.jobs.values() if j.stop is not None and j.stage != "loading"]:
            if job.stage == "running":
                with contextlib.suppress(Exception):
                    self.batch.cancel(job.rid)
            self._drop(job)
            self._spawn(self._stopped(job))

    def _step_failed(self, exc: Exception) -> None:
        """A step that raised leaves the batch in an unknown state: every running sequence
        is handed back for redelivery (its retry budget ends it if this keeps happening)."""
        log.exception("decode step failed: %d sequences handed back", len(self.batch))
        running = [self.jobs[rid] for rid in list(self.batch.running) if rid in self.jobs]
        self.batch = DecodeBatch(self.engine)
        for job in running:
            self._drop(job)
            job.span.record_exception(exc)
            job.span.end()
            self.streamer.discard(job.rid)
            self._spawn(job.msg.nak(delay=_backoff(job.msg)))

    # --- ends -----------------------------------------------------------------------------

    async def _complete(self, job: Job, c: Completion) -> None:
        w = job.work
        event_id = ev.derived_event_id(w.admitted_event_id, "decode.completed")
        try:
            with trace.use_span(job.span, end_on_exit=False):
                if await terminal.claim(self.kv, w.request_id, "completed", event_id):
                    reason: Literal["stop", "length"] = (
                        "length" if c.finish_reason == "length" else "stop"
                    )
                    ttft = max(w.first_token_at - w.timing.submitted_at, 0.0)
                    tbt = slowest_tenth_mean(job.times)
                    await self.ctx.publisher.publish(
                        ev.RequestCompleted(
                            event_id=event_id,
                            request_id=w.request_id,
                            output_tokens=len(c.tokens),
                            finish_reason=reason,
                            ttft_s=ttft,
                            tbt_s=tbt,
                            text=c.text or None,
                        )
                    )
                    observe_completed(reason, ttft, tbt)
                    await self.streamer.close(
                        TokenChunk(
                            request_id=w.request_id,
                            index=max(len(c.tokens), 1),
                            text=job.texts.rest(c.text),
                            done=True,
                            finish_reason=reason,
                        )
                    )
                else:
                    log.info("%s: ended elsewhere before it completed here", w.request_id)
                    self.streamer.discard(w.request_id)
            await job.msg.ack()
        except Exception as exc:
            # Not settled: the message is redelivered and the same claim wins again.
            log.exception("%s: completing failed", w.request_id)
            job.span.record_exception(exc)
            self.streamer.discard(w.request_id)
        else:
            await self._remove_tail(w)
        finally:
            job.span.set_attribute("mc.output_tokens", len(c.tokens))
            job.span.end()

    async def _stopped(self, job: Job) -> None:
        """A job told to stop: cancelled by the client, past its deadline, or ended by
        another instance."""
        w, why = job.work, job.stop or ""
        cancelled = why == "client" or why == "ended:cancelled"
        try:
            with trace.use_span(job.span, end_on_exit=False):
                if why == "deadline":
                    event_id = ev.derived_event_id(w.admitted_event_id, "decode.cancelled")
                    if await terminal.claim(self.kv, w.request_id, "cancelled", event_id):
                        await self.ctx.publisher.publish(
                            ev.RequestCancelled(
                                event_id=event_id,
                                request_id=w.request_id,
                                reason="deadline",
                                stage="decode",
                            )
                        )
                        metrics.REQUESTS_ENDED.labels("cancelled", ROLE, "deadline").inc()
                        cancelled = True
                if cancelled:
                    await self.streamer.close(
                        TokenChunk(
                            request_id=w.request_id,
                            index=max(job.sent, 1),
                            done=True,
                            finish_reason="cancelled",
                        )
                    )
                else:
                    self.streamer.discard(w.request_id)
            await job.msg.ack()
            log.info("%s: stopped (%s) after %d tokens", w.request_id, why, job.sent)
        except Exception as exc:
            log.exception("%s: stopping failed", w.request_id)
            job.span.record_exception(exc)
        else:
            await self._remove_tail(w)
        finally:
            job.span.set_attribute("mc.stopped", why)
            job.span.end()

    async def _fail_work(
        self, work: DecodeWork, msg: Msg, reason: str, detail: str, job: Job | None = None
    ) -> None:
        event_id = ev.derived_event_id(work.admitted_event_id, "decode.failed")
        try:
            if await terminal.claim(self.kv, work.request_id, "failed", event_id):
                await self.ctx.publisher.publish(
                    ev.RequestFailed(
                        event_id=event_id,
                        request_id=work.request_id,
                        reason=reason,
                        stage="decode",
                        detail=detail[:2000],
                    )
                )
                metrics.REQUESTS_ENDED.labels("failed", ROLE, reason).inc()
                if work.request_id not in self.streamer:
                    self.streamer.open(work.request_id, work.reply_to)
                await self.streamer.close(
                    TokenChunk(
                        request_id=work.request_id,
                        index=max(job.sent if job else 1, 1),
                        done=True,
                        finish_reason="failed",
                        error=detail[:2000],
                    )
                )
            else:
                self.streamer.discard(work.request_id)
            await msg.ack()
        except Exception:
            log.exception("%s: failing it failed", work.request_id)
        else:
            await self._remove_tail(work)
        finally:
            if job is not None:
                job.span.set_attribute("mc.failed", reason)
                job.span.end()

    async def _end_quietly(self, work: DecodeWork, msg: Msg) -> None:
        with contextlib.suppress(Exception):
            await msg.ack()
        await self._remove_tail(work)

    async def _remove_tail(self, work: DecodeWork) -> None:
        """The tail object belongs to this request alone: gone when the request ends."""
        if work.tail_key:
            try:
                await self.store.client.remove_many([work.tail_key], force=True)
            except Exception as exc:
                log.debug("%s: tail not removed: %s", work.request_id, exc)

    async def _dead_letter(self, msg: Msg, reason: str, detail: str) -> None:
        durable = self._consumer.spec.durable
        meta = msg.metadata
        headers = {
            MSG_ID: f"dlq:{meta.stream}:{meta.sequence.stream}:{durable}",
            "Mc-Dlq-Reason": reason,
            "Mc-Dlq-Detail": "".join(c if c.isprintable() else " " for c in detail)[:1000],
            "Mc-Dlq-Stream": str(meta.stream),
            "Mc-Dlq-Seq": str(meta.sequence.stream),
            "Mc-Dlq-Subject": msg.subject,
            "Mc-Dlq-Consumer": durable,
        }
        try:
            await self.ctx.publisher.publish_raw(
                self.ctx.ns.dead_letter_subject(durable), msg.data, headers
            )
            await msg.term()
            log.warning("dead-lettered decode work seq %d: %s", meta.sequence.stream, reason)
        except Exception:
            log.exception("dead-lettering failed; the message will be redelivered")

    # --- the side loops ---------------------------------------------------------------------

    async def _on_cancel(self, msg: Msg) -> None:
        event = ev.parse_event(msg.data)
        if isinstance(event, ev.CancelRequested):
            job = self.jobs.get(event.request_id)
            if job is not None and job.stop is None:
                job.stop = "client"
                self._wake.set()

    async def _heartbeats(self) -> None:
        every = self.ctx.settings.bus.ack_wait_s / 3
        while True:
            await asyncio.sleep(every)
            for job in list(self.jobs.values()):
                with contextlib.suppress(Exception):
                    await job.msg.in_progress()

    async def _reconcile(self) -> None:
        """Requests ended elsewhere (cancelled while a core-NATS cancel was lost, completed
        by another instance after a redelivery) leave the batch too."""
        while True:
            await asyncio.sleep(RECONCILE_EVERY_S)
            for job in list(self.jobs.values()):
                if job.stop is not None:
                    continue
                with contextlib.suppress(Exception):
                    how = await terminal.ended(self.kv, job.rid)
                    if how is not None and job.stop is None:
                        job.stop = f"ended:{how}"
                        self._wake.set()

    def load_report(self) -> LoadReport:
        self._load_seq += 1
        return LoadReport(
            instance=self.instance,
            role="decode",
            node=self.store.node_id,
            seq=self._load_seq,
            at=time.time(),
            queued=sum(1 for j in self.jobs.values() if j.stage != "running"),
            queued_tokens=0,
            running=len(self._running()),
            context_tokens=self.context_tokens,
            kv_capacity_tokens=self.capacity,
        )

    async def _load_reports(self) -> None:
        subject = self.subjects.load(self.instance)
        while True:
            report = self.load_report()
            self._queued_gauge.set(report.queued)
            self._running_gauge.set(report.running)
            metrics.DECODE_CONTEXT_TOKENS.set(report.context_tokens)
            with contextlib.suppress(Exception):
                await self.ctx.nc.publish(subject, report.to_json())
            await asyncio.sleep(LOAD_EVERY_S)


async def run(ctx: WorkerContext, engine: Engine | None = None) -> None:
    if engine is None:
        engine = await asyncio.to_thread(build_engine, ctx.settings)
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

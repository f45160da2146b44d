"""The prefill worker: one instance of the prefill pool (PAPER.md §3, steps 1-3).

Takes `PrefillWork` from `mc.prefill.<instance>` (stream MC_WORK, durable consumer
`prefill-<instance>`), one request at a time in arrival order, and for each:

1. skips it if the request already ended (terminal bucket) or its deadline passed (then ends
   it as `cancelled`, reason `deadline`);
2. publishes `PrefillStarted`;
3. loads the cached prefix blocks from the store layer by layer, computes the rest with the
   engine and writes every new block (and the partial tail) to the store layer by layer while
   computing (`mooncake.serving.prefill_kv`), sending `in_progress` while it runs;
4. samples the first token and sends it to the request's `reply_to` at once (TTFT);
5. publishes `RequestPrefilled` and the `DecodeWork` for the chosen decode instance, then acks.

Every event and work message it emits has an id derived from the admission event and the
attempt, so a redelivered work item re-emits the same ids (deduplicated downstream).

Bad input (EngineError) fails the request; store or broker trouble retries the work with
backoff until `bus.max_deliver`, then fails it (`retries_exhausted`). A `CancelRequested` for
the request being prefilled (or its deadline) stops it at the next layer boundary and revokes
its pending puts; the Conductor publishes the cancellation, this worker only stops.

It also embeds its own store node (its DRAM is this instance's local prefix cache) and
publishes a `LoadReport` on `mc.load.<instance>` every 0.25 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Final

from nats.aio.msg import Msg
from nats.js.kv import KeyValue
from opentelemetry.trace import Span
from pydantic import ValidationError

from mooncake import events as ev
from mooncake import memory, metrics
from mooncake.aio import cancel_all
from mooncake.bus import terminal
from mooncake.bus.consume import (
    ACK,
    ConsumerSpec,
    DeadLetter,
    Delivery,
    Outcome,
    PullConsumer,
    Retry,
    per_message,
)
from mooncake.bus.heartbeat import keep_alive
from mooncake.bus.publish import MSG_ID
from mooncake.config import Settings
from mooncake.engine import Engine, EngineError, compute
from mooncake.engine.batch import is_stop_token
from mooncake.engine.sampling import make_generator, sample
from mooncake.serving.cpp_group import CppGroups, GroupFailed
from mooncake.serving.ending import Ender, final, observe_completed
from mooncake.serving.engine_tier import EngineTier
from mooncake.serving.kvstore import TIERS, PrefillCancelled
from mooncake.serving.local_store import LocalStore, local_store
from mooncake.serving.models import build_engine, calibrate_engine, engine_params
from mooncake.serving.prefill_kv import (
    StoredPrefill,
    prefill_with_store,
    remove_tail,
    replicate_blocks,
)
from mooncake.telemetry import inject_headers, tracer
from mooncake.work import (
    DecodeWork,
    EngineTiming,
    LoadReport,
    PrefillWork,
    TokenChunk,
    WorkSubjects,
    completed_event_id,
    tail_key,
)
from workers.runtime import WorkerContext, configure_logging, worker_context

log = logging.getLogger("mooncake.prefill")

ROLE: Final = "prefill"
LOAD_INTERVAL_S = 0.25
QUEUE_POLL_S = 1.0  # how often the consumer's pending count is asked for (a JetStream call)
DONE_MEMORY = 4096  # (request, attempt) pairs finished here: a redelivery of one is just acked


def consumer_spec(instance: str) -> ConsumerSpec:
    return ConsumerSpec("MC_WORK", f"{ROLE}-{instance}", f"mc.prefill.{instance}")


def first_token(engine: Engine, done: StoredPrefill, params: ev.SamplingParams) -> int:
    """The request's first output token, sampled from the prefill's last-position logits
    exactly as the engine's own batch does it (a fresh generator seeded from the params)."""
    logits = done.prefilled.logits
    logits = logits if logits.dim() == 1 else logits[-1]
    p = engine_params(params)
    return sample(logits, p, make_generator(p, engine.device))


def event_id(work: PrefillWork, kind: str) -> str:
    return ev.derived_event_id(work.admitted_event_id, f"{kind}-{work.attempt}")


def observe_prefill(done: StoredPrefill, prompt_tokens: int, block_tokens: int) -> None:
    """Count a finished prefill's prompt tokens, and per tier where their KV came from."""
    metrics.PREFILL_PROMPT_TOKENS.inc(prompt_tokens)
    for tier, tokens in done.tokens_by_tier(prompt_tokens, block_tokens).items():
        if tokens:
            metrics.PREFILL_KV_TOKENS.labels(tier).inc(tokens)


@dataclass
class Running:
    """The request being prefilled now, and how to stop it."""

    request_id: str
    tokens: int  # prompt tokens still to compute (an estimate until the prefix is loaded)
    stop: threading.Event
    reason: str | None = None  # why it was stopped: "cancel" or "deadline"

    def halt(self, reason: str) -> None:
        if self.reason is None:
            self.reason = reason
        self.stop.set()


class PrefillWorker:
    def __init__(
        self, ctx: WorkerContext, engine: Engine, store: LocalStore, terminal_kv: KeyValue
    ) -> None:
        self._ctx, self.engine, self.store, self._terminal = ctx, engine, store, terminal_kv
        self.ender = Ender(ctx.nc, ctx.publisher, terminal_kv)
        self.subjects = WorkSubjects(ctx.ns)
        # One prefill at a time and nothing waiting here: a prefill outlasts the ack wait.
        self.consumer = PullConsumer(
            ctx.nc, ctx.js, consumer_spec(ctx.instance_id), ctx.settings.bus, ctx.ns, batch=1,
            prefetch=False,
        )  # fmt: skip
        self.running: Running | None = None
        self.groups = CppGroups(ctx.nc, self.subjects, ctx.instance_id, engine, store,
                                ctx.settings)  # fmt: skip
        self._done: OrderedDict[tuple[str, int], None] = OrderedDict()
        self._background: set[asyncio.Task[None]] = set()
        self._copying: dict[int, asyncio.Task[None]] = {}  # replications holding a prompt's KV
        self._seq = 0
        self._queued = 0
        self.calibration: list[EngineTiming] = []  # the engine's prefill timings at start
        self.last: StoredPrefill | None = None  # the last prefill's details (tests, debugging)
        for tier in TIERS:  # every tier's series exists from the start (rates need it)
            metrics.PREFILL_KV_TOKENS.labels(tier)
        self._queued_gauge = metrics.WORKER_QUEUED.labels(ROLE)
        self._running_gauge = metrics.WORKER_RUNNING.labels(ROLE)

    # --- the loop -------------------------------------------------------------------------

    async def run(self) -> None:
        await self.consumer.ensure()  # work sent meanwhile waits in it, not lost
        self.calibration = await calibrate_engine(self.engine, self._ctx.settings, ROLE)
        sub = await self._ctx.nc.subscribe(self.subjects.cancel(), cb=self._on_cancel)
        await self.groups.start()
        reports = asyncio.create_task(self._report_load())
        tier = EngineTier(self._ctx.nc, self._ctx.ns, self._ctx.instance_id, self.engine.pool.pages)
        announce = asyncio.create_task(tier.run())
        try:
            handler = per_message(self.handle, "prefill")
            # Work delivered past max_deliver (this instance killed while holding it, after
            # tries the store refused) is tried once more, not dead-lettered: `_transient`
            # fails it if that try fails too, so it ends either way.
            await self.consumer.run(handler, self._ctx.stop, exhausted=handler)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            await self.groups.stop()
            await cancel_all([reports, announce, *self._background])

    async def _on_cancel(self, msg: Msg) -> None:
        event = ev.parse_event(msg.data)
        running = self.running
        if (
            isinstance(event, ev.CancelRequested)
            and running is not None
            and event.request_id == running.request_id
        ):
            log.info("cancel of %s: stopping its prefill", event.request_id)
            running.halt("cancel")

    # --- one work item --------------------------------------------------------------------

    async def handle(self, d: Delivery) -> Outcome:
        try:
            work = PrefillWork.model_validate_json(d.data)
        except ValidationError as exc:
            return DeadLetter("invalid_work", str(exc)[:1000])
        if (work.request_id, work.attempt) in self._done:
            return ACK  # a redelivery of work finished here (its ack was lost or late)
        running = Running(work.request_id, len(work.token_ids), threading.Event())
        self.running = running  # before any await: a cancel arriving now is not missed
        try:
            if await self._ended(work):
                return ACK
            deadline = work.timing.deadline_at
            if deadline is not None and time.time() >= deadline:
                return await self._cancelled(work, "deadline")
            interval = max(self._ctx.settings.bus.ack_wait_s / 3, 0.1)
            # One compute window over the work: the heap is given back once it is done.
            async with keep_alive(d, interval), memory.compute_window():
                if work.cpp is not None and work.cpp.stage > 0:
                    return await self._stage(work, d, running)
                return await self._prefill(work, d, running)
        finally:
            self.running = None

    async def _prefill(self, work: PrefillWork, d: Delivery, running: Running) -> Outcome:
        ctx = self._ctx
        await ctx.publisher.publish(
            ev.PrefillStarted(
                event_id=event_id(work, "prefill-started"),
                request_id=work.request_id,
                instance=ctx.instance_id,
                attempt=work.attempt,
            )
        )
        timer = self._deadline_timer(work, running)
        started = time.perf_counter()
        try:
            with tracer().start_as_current_span(
                "prefill compute",
                attributes={
                    "mc.request_id": work.request_id,
                    "mc.tokens": len(work.token_ids),
                    "mc.tenant": work.tenant,
                },
            ) as span:
                done, stages, fallback = await self._prefill_kv(work, d, running, span)
        except EngineError as exc:
            return await self._failed(work, "invalid_prompt", str(exc))
        except PrefillCancelled:
            if running.reason == "deadline":
                return await self._cancelled(work, "deadline")
            log.info("prefill of %s stopped (%s)", work.request_id, running.reason)
            return ACK
        except Exception as exc:
            return await self._transient(work, d, exc)
        finally:
            if timer is not None:
                timer.cancel()
        prefill_s = time.perf_counter() - started
        self.last = done
        observe_prefill(done, len(work.token_ids), self.engine.block_tokens)
        try:
            return await self._hand_over(work, done, prefill_s, stages, fallback)
        except Exception as exc:
            return await self._transient(work, d, exc)
        finally:
            if not self._replicating(done):
                done.release()  # its whole blocks stay cached in the pool (the engine tier)

    async def _prefill_kv(
        self, work: PrefillWork, d: Delivery, running: Running, span: Span
    ) -> tuple[StoredPrefill, list[str], str | None]:
        """The prompt's KV in the store: by its CPP group where it has one, else (or where
        the group is given up) by this instance alone. Also the group that did it, and why
        a group given did not."""
        fallback = None
        if work.cpp is not None:
            span.set_attribute("mc.cpp.group", ",".join(work.cpp.group))
            span.set_attribute("mc.cpp.chunks", len(work.cpp.chunks))
            if d.num_delivered > 1:
                # Redelivered (this instance restarted, or a try failed): its members have
                # moved on, and a group met out of the Conductor's order could wait on
                # another. Alone.
                fallback = f"delivery {d.num_delivered}: a group meets on the first only"
            else:
                try:
                    done = await self.groups.lead(work, running.stop)
                    return done, list(work.cpp.group), None
                except GroupFailed as exc:
                    fallback = str(exc)
                    log.warning("%s: its group gave up (%s); prefilling it alone",
                                work.request_id, fallback)  # fmt: skip
                    span.set_attribute("mc.cpp.fallback", fallback)
                    metrics.CPP_FALLBACKS.inc()
        done = await prefill_with_store(
            self.engine,
            self.store.client,
            work.token_ids,
            cached_blocks=work.cached_blocks,
            load_limit=work.load_limit_blocks,
            tail_key=tail_key(work.request_id, work.attempt),
            preferred_segment=self.store.dram_segment,
            cancelled=running.stop,
            namespace=work.cache_namespace,
        )
        return done, [], fallback

    async def _stage(self, work: PrefillWork, d: Delivery, running: Running) -> Outcome:
        """A stage of a group another instance leads (`cpp_group.CppGroups.serve_stage`).
        The leader owns the request: this stage never ends it, it only does its part or
        drops it (the leader then prefills alone), and acks either way. A redelivered stage
        is dropped: its leader gave the group up when this instance went silent, and a
        stage met out of the Conductor's order could keep another group waiting."""
        assert work.cpp is not None
        if await self._ended(work) or d.num_delivered > 1:
            metrics.CPP_STAGES.labels("dropped").inc()
            return ACK
        timer = self._deadline_timer(work, running)
        try:
            with tracer().start_as_current_span(
                "prefill stage",
                attributes={
                    "mc.request_id": work.request_id,
                    "mc.cpp.stage": work.cpp.stage,
                    "mc.cpp.leader": work.cpp.group[0],
                    "mc.cpp.chunks": len(work.cpp.chunks),
                },
            ) as span:
                why = await self.groups.serve_stage(work, running.stop)
                if why is not None:
                    span.set_attribute("mc.cpp.dropped", why)
        finally:
            if timer is not None:
                timer.cancel()
        if why is None:
            metrics.CPP_STAGES.labels("done").inc()
        else:
            metrics.CPP_STAGES.labels("dropped").inc()
            log.info("stage %d of %s dropped: %s", work.cpp.stage, work.request_id, why)
        return ACK

    def _deadline_timer(self, work: PrefillWork, running: Running) -> asyncio.TimerHandle | None:
        deadline = work.timing.deadline_at
        if deadline is None:
            return None
        loop = asyncio.get_running_loop()
        return loop.call_later(max(deadline - time.time(), 0.0), running.halt, "deadline")

    async def _hand_over(
        self, work: PrefillWork, done: StoredPrefill, prefill_s: float,
        stages: list[str] | None = None, fallback: str | None = None,
    ) -> Outcome:  # fmt: skip
        """First token to the client, then the facts and the decode work. `stages`: the CPP
        group that prefilled it; `fallback`: why the group it was given did not."""
        ctx = self._ctx
        token = first_token(self.engine, done, work.params)
        first_at = time.time()
        # A stop token first (EOS, say): the answer is empty and ends here, no decode. It is
        # not sent as a token (a decoded stop token is not output either).
        ends_here = is_stop_token(token, engine_params(work.params), self.engine.tokenizer)
        if work.reply_to and not ends_here:
            text = self.engine.tokenizer.decode([token]) if self.engine.tokenizer else ""
            chunk = TokenChunk(request_id=work.request_id, index=0, token_ids=[token], text=text)
            await ctx.nc.publish(work.reply_to, chunk.to_json())
        metrics.TOKENS_GENERATED.labels(ROLE).inc()
        if await self._ended(work):
            return ACK  # cancelled (or failed elsewhere) while it computed: nothing to hand on
        block = self.engine.block_tokens
        remote = max(done.loaded_blocks - min(work.local_blocks, done.loaded_blocks), 0)
        await ctx.publisher.publish(
            ev.RequestPrefilled(
                event_id=event_id(work, "prefilled"),
                request_id=work.request_id,
                instance=ctx.instance_id,
                prompt_tokens=len(work.token_ids),
                cached_tokens=done.loaded_blocks * block,
                remote_cached_tokens=remote * block,
                kv_keys=done.block_keys,
                first_token_id=token,
                prefill_s=prefill_s,
                stages=stages or [],
                cpp_fallback=fallback[:1000] if fallback else None,
            )
        )
        if ends_here:
            await self._completed_empty(work, done, first_at)
        else:
            await self._send_decode_work(work, done, token, first_at)
        self._remember(work)
        if remote:
            self._replicate(done, work.local_blocks)
        return ACK

    async def _ended(self, work: PrefillWork) -> bool:
        """Ended already (cancelled, failed elsewhere, or completed by a redelivery of this
        work); not when the claim is this stage's own completion, which may never have been
        published (`terminal.ended(redo=...)`)."""
        redo = completed_event_id(work.admitted_event_id, "prefill")
        return await terminal.ended(self._terminal, work.request_id, redo=redo) is not None

    async def _completed_empty(
        self, work: PrefillWork, done: StoredPrefill, first_at: float
    ) -> None:
        """The request whose first token is a stop token: completed with no output. Its
        partial tail block was stored for a decode that will not come: removed, as decode
        removes it when a request ends."""
        ttft = max(first_at - work.timing.submitted_at, 0.0)
        event = ev.RequestCompleted(
            event_id=completed_event_id(work.admitted_event_id, "prefill"),
            request_id=work.request_id,
            output_tokens=0, finish_reason="stop", ttft_s=ttft,
        )  # fmt: skip
        last = final(work.request_id, 0, "stop")
        if await self.ender.end(event, last, reply_to=work.reply_to):
            observe_completed(ROLE, "stop", ttft, None)
        await remove_tail(self.store.client, work.request_id, done.tail_key)

    async def _send_decode_work(
        self, work: PrefillWork, done: StoredPrefill, token: int, first_at: float
    ) -> None:
        decode = DecodeWork(
            request_id=work.request_id,
            attempt=work.attempt,
            token_ids=work.token_ids,
            first_token_id=token,
            kv_keys=done.block_keys,
            tail_key=done.tail_key,
            tail_tokens=done.tail_tokens,
            params=work.params,
            reply_to=work.reply_to,
            prefill_instance=work.prefill_instance,
            decode_instance=work.decode_instance,
            timing=work.timing,
            first_token_at=first_at,
            admitted_event_id=work.admitted_event_id,
        )
        headers = {
            MSG_ID: ev.derived_event_id(work.admitted_event_id, f"decode-work-{work.attempt}")
        }
        inject_headers(headers)
        await self._ctx.publisher.publish_raw(
            self.subjects.decode(work.decode_instance), decode.to_json(), headers
        )

    def _replicate(self, done: StoredPrefill, local_blocks: int) -> None:
        """Keep copies of the blocks fetched from remote nodes (after the prefill: never on
        its critical path). The copy reads the prompt's pages, so it gives them back."""
        keys = [(done.block_keys[j], j) for j in range(local_blocks, done.loaded_blocks)]
        kv, block = done.prefilled.kv, self.engine.block_tokens

        async def copy() -> None:
            try:
                placed = await replicate_blocks(
                    self.store.client, kv, keys, block, self.store.dram_segment,
                    namespace=done.namespace,
                )  # fmt: skip
                log.debug("replicated %d of %d remote blocks", placed, len(keys))
            except Exception as exc:
                log.warning("hot-block replication failed: %s", exc)
            finally:
                done.release()

        task = asyncio.create_task(copy())
        self._background.add(task)
        self._copying[id(done)] = task
        task.add_done_callback(lambda t: self._copying.pop(id(done), None))
        task.add_done_callback(self._background.discard)

    def _replicating(self, done: StoredPrefill) -> bool:
        return id(done) in self._copying

    def _remember(self, work: PrefillWork) -> None:
        self._done[(work.request_id, work.attempt)] = None
        while len(self._done) > DONE_MEMORY:
            self._done.popitem(last=False)

    # --- endings ----------------------------------------------------------------------------

    async def _transient(self, work: PrefillWork, d: Delivery, exc: Exception) -> Outcome:
        detail = f"{type(exc).__name__}: {exc}"[:1000]
        if d.num_delivered >= self._ctx.settings.bus.max_deliver:
            log.error("prefill of %s failed for good: %s", work.request_id, detail)
            return await self._failed(work, "retries_exhausted", detail)
        log.warning("prefill of %s failed (try %d): %s", work.request_id, d.num_delivered, detail)
        return Retry(detail)

    async def _failed(self, work: PrefillWork, reason: str, detail: str) -> Outcome:
        eid = event_id(work, "prefill-failed")
        if await self.ender.fail(work.request_id, eid, reason=reason, stage="prefill",
                                 detail=detail, reply_to=work.reply_to):  # fmt: skip
            metrics.REQUESTS_ENDED.labels("failed", ROLE, reason).inc()
        return ACK

    async def _cancelled(self, work: PrefillWork, reason: str) -> Outcome:
        eid = event_id(work, "prefill-cancelled")
        if await self.ender.cancel(work.request_id, eid, reason=reason, stage="prefill",
                                   reply_to=work.reply_to):  # fmt: skip
            metrics.REQUESTS_ENDED.labels("cancelled", ROLE, reason).inc()
        return ACK

    # --- load reports -------------------------------------------------------------------------

    async def _report_load(self) -> None:
        ctx = self._ctx
        subject = self.subjects.load(ctx.instance_id)
        polled = 0.0
        while True:
            now = time.monotonic()
            if now - polled >= QUEUE_POLL_S:
                polled = now
                await self._poll_queue()
            self._seq += 1
            running = self.running
            report = LoadReport(
                instance=ctx.instance_id,
                role=ROLE,
                node=self.store.node_id,
                seq=self._seq,
                at=time.time(),
                queued=self._queued,
                queued_tokens=running.tokens if running is not None else 0,
                running=1 if running is not None else 0,
                calibration=self.calibration,
            )
            self._queued_gauge.set(report.queued)
            self._running_gauge.set(report.running)
            with contextlib.suppress(Exception):
                await ctx.nc.publish(subject, report.to_json())
            await asyncio.sleep(LOAD_INTERVAL_S)

    async def _poll_queue(self) -> None:
        """Work waiting for this instance: pending in the stream plus delivered, unacked
        messages other than the one running."""
        spec = self.consumer.spec
        try:
            info = await self._ctx.js.consumer_info(spec.stream, spec.durable, timeout=0.5)
        except Exception:
            return  # keep the last count
        pending = (info.num_pending or 0) + (info.num_ack_pending or 0)
        self._queued = max(pending - (1 if self.running is not None else 0), 0)


async def serve(ctx: WorkerContext, engine: Engine) -> None:
    """Run one prefill instance with this engine until `ctx.stop` is set."""
    terminal_kv = await terminal.open_bucket(ctx.js, ctx.ns, ctx.settings.bus.replicas)
    async with local_store(ctx.nc, ctx.settings, node_id=ctx.instance_id) as store:
        await PrefillWorker(ctx, engine, store, terminal_kv).run()


async def main(settings: Settings, instance_id: str | None = None) -> None:
    engine = compute.call(build_engine, settings, ROLE)  # on the thread its prefills run on
    async with worker_context(settings, ROLE, instance_id) as ctx:
        await serve(ctx, engine)


if __name__ == "__main__":
    from mooncake.config import load_settings

    s = load_settings()
    configure_logging(s.log_level)
    asyncio.run(main(s))

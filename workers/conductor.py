"""The Conductor process: ingress validation, request-id dedupe, admission and dispatch,
cancellation and failure recovery.

Consumes `mc.req.submitted` (durable consumer "conductor"), validates every message once
(`mooncake.core.ingress`), rejects a named client's submissions beyond its per-client limit
(`client_rate_limited`), turns the prompt into tokens and chained block keys, and asks the
core (Algorithm 1 + the configured admission policy, `mooncake.core.admission`) for a
Decision against a ClusterView kept current from the bus (`serving.conductor_feed`). It
publishes `mc.req.admitted` (and the `PrefillWork` on `mc.prefill.<instance>`) or
`mc.req.rejected`, each with every input of the decision; the decision also goes to the
request's `reply_to`. Events it emits have ids derived from the submission's id, so a
redelivered submission produces the same events again and the broker/recorder drop the
copies. With no instance to send work to yet (start-up), a submission is retried for
`conductor.no_instance_wait_s` before it is rejected with `no_instance`.

Also: `mc.req.cancel` (durable consumer "conductor-cancel") ends a request as cancelled;
the reaper (`serving.conductor_reaper`) re-dispatches a dead instance's work.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from nats.js.api import KeyValueConfig, PubAck, StorageType
from nats.js.errors import KeyWrongLastSequenceError
from nats.js.kv import KeyValue
from opentelemetry import trace

from mooncake import events as ev
from mooncake import metrics
from mooncake.bus import terminal
from mooncake.bus.consume import (
    ACK,
    ConsumerSpec,
    DeadLetter,
    Delivery,
    Outcome,
    PullConsumer,
    Retry,
    consumer_span,
    per_message,
)
from mooncake.bus.publish import MSG_ID
from mooncake.client import SUBMISSIONS
from mooncake.config import Settings
from mooncake.core import admission, ingress
from mooncake.core import cluster as cl
from mooncake.core import conductor as cd
from mooncake.core.cost_model import Costs
from mooncake.core.online_cost import observe_fact
from mooncake.engine.errors import EngineError
from mooncake.events import RejectReason
from mooncake.hashing import request_keys
from mooncake.model_info import ModelHeader, model_header
from mooncake.ratelimit import ClientLimits, Limit
from mooncake.serving import conductor_dispatch as dispatch
from mooncake.serving.conductor_feed import LiveFeed, Liveness, Member
from mooncake.serving.conductor_reaper import Reaper
from mooncake.serving.conductor_setup import build_costs, conductor_config, online_model
from mooncake.serving.conductor_sweep import InflightSweep
from mooncake.serving.conductor_terminal import (
    Known,
    KnownRequests,
    cancel_stage,
    cancelled_event_id,
)
from mooncake.serving.ending import Ender, reply
from mooncake.serving.token_readback import TokenReadBack
from mooncake.store.kv_index import IndexState
from mooncake.telemetry import inject_headers
from mooncake.work import PrefillWork, WorkSubjects
from workers.runtime import WorkerContext, configure_logging, worker_context

log = logging.getLogger("mooncake.conductor")

SUBMITTED = SUBMISSIONS  # the client checks it for a live Conductor (`check_admitting`)
CANCELS = ConsumerSpec("MC_REQ", "conductor-cancel", ev.CancelRequested.SUBJECT)
REQUEST_IDS_BUCKET = "MC_REQUEST_IDS"  # canonical; namespaced like the streams
REQUEST_ID_TTL_S = 24 * 3600.0
# Request ids cancelled recently, remembered here so admission need not ask the bucket.
CANCELLED_MEMORY = 100_000
TERMINAL_CHECK_AFTER_START_S = 5.0
NO_TOKENIZER = (
    "a text prompt needs the model's tokenizer and the configured model (dummy) has none: "
    "send token_ids"
)


# What the decision step hands the publish step: a retry, an (event, stage) rejection, or
# the admission with its prefill work.
Plan = Retry | tuple[ev.RequestRejected, str] | tuple[ev.RequestAdmitted, PrefillWork]


async def _none() -> None:
    return None


def _not_exact(states: Mapping[str, tuple[IndexState, float]]) -> dict[str, str]:
    return {n: state.value for n, (state, _) in states.items() if state is not IndexState.EXACT}


def _failed(span: trace.Span, exc: BaseException) -> Outcome:
    """Any failure of one message is a retry of that message, never a dead consumer."""
    log.error("admit failed: %s: %s", type(exc).__name__, exc)
    span.record_exception(exc)
    return Retry(f"{type(exc).__name__}: {exc}"[:500])


class Conductor:
    def __init__(
        self,
        ctx: WorkerContext,
        request_ids: KeyValue,
        terminal_kv: KeyValue,
        model: ModelHeader | None,
        costs: Costs,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        s = ctx.settings
        self._ctx = ctx
        self._ids = request_ids
        self._terminal = terminal_kv
        # The model's header: its tokenizer (text prompts), vocabulary and context. None when
        # the model file cannot be read: text prompts are rejected, token ids are checked
        # against the dummy shape's vocabulary only, and the context by the prefill.
        self._tokenizer = model.tokenizer if model is not None else None
        self._vocab = model.spec.vocab_size if model is not None else s.engine.dummy.vocab
        self._context = model.spec.context if model is not None else None
        self._policy: admission.Policy = s.admission_policy
        self._reserved = ingress.reserved_reply_prefixes(ctx.ns.prefix)
        self._cfg = conductor_config(s, model.spec.layers if model is not None else None)
        self._costs = costs
        self._online = online_model(costs)  # refitted from the workers' timings, or None
        self._clock = clock
        self._subjects = WorkSubjects(ctx.ns)
        self.view = cl.ClusterView(s.conductor.max_index_keys)
        self.known = KnownRequests()
        self._client_limit = Limit(s.conductor.client_rate_per_s, s.conductor.client_burst)
        self._client_limits = ClientLimits(self._client_limit)
        self._cancelled: OrderedDict[str, None] = OrderedDict()
        self._started = clock()
        self.ender = Ender(ctx.nc, ctx.publisher, terminal_kv)
        self.reaper = Reaper(
            ctx.nc, ctx.js, s, self.view, self._cfg, costs, self.ender, clock=clock
        )
        self.liveness = Liveness(s.conductor.liveness_timeout_s)
        # Tokens read back for clients that may not read MC_TOKENS (the gateway).
        self.read_back = TokenReadBack(ctx.nc, ctx.js, ctx.ns)
        self.sweep = InflightSweep(
            self.view, terminal_kv, s.conductor.inflight_check_after_s,
            lambda rid: self.feed.apply(cl.RequestDropped(rid)), clock=clock,
        )  # fmt: skip
        self.feed = LiveFeed(
            ctx.nc, ctx.ns, self.view, self.liveness,
            on_dead=self._on_dead, on_fact=self._on_fact,
            tick_s=min(s.conductor.load_report_interval_s, s.conductor.liveness_timeout_s / 4),
            clock=clock,
        )  # fmt: skip

    async def _on_dead(self, member: Member) -> None:
        self.reaper.watch(member)

    def _on_fact(self, fact: cl.Fact) -> None:
        if self._online is not None:
            refits = self._online.refits
            stage = observe_fact(self._online, fact)
            if stage is not None:
                error = self._online.error(stage)
                if error is not None:
                    metrics.COST_MODEL_ERROR.labels(stage).set(error)
                if self._online.refits > refits:
                    metrics.COST_MODEL_REFITS.labels(stage).inc()
                    if stage == "prefill":  # the queues are the new model's too
                        self.view.reestimate(self._costs.prefill.prefill_s, self._clock())
        if isinstance(fact, cl.InstanceJoined):
            log.info("%s instance %s joined (node %s)", fact.role, fact.instance, fact.node)
            self.reaper.revived(fact.instance)

    async def _first_submission(self, request: ev.RequestSubmitted) -> bool:
        """True for the first submission of a request id (or a redelivery of it)."""
        key = hashlib.sha256(request.request_id.encode()).hexdigest()[:48]
        try:
            await self._ids.create(key, request.event_id.encode())
            return True
        except KeyWrongLastSequenceError:
            entry = await self._ids.get(key)
            return entry.value == request.event_id.encode()

    def _prompt_tokens(self, request: ev.RequestSubmitted) -> list[int] | str:
        """The prompt's token ids, or why there are none (an invalid_request detail)."""
        if request.token_ids is not None:
            tokens = list(request.token_ids)
        elif self._tokenizer is None:
            return NO_TOKENIZER
        else:
            assert request.prompt is not None
            try:
                tokens = self._tokenizer.encode_chat([{"role": "user", "content": request.prompt}])
            except EngineError as e:
                return str(e)
        if not tokens:
            return "the prompt has no tokens"
        if (bad := max(tokens)) >= self._vocab:
            return f"token id {bad} is outside the model's vocabulary of {self._vocab}"
        return tokens

    async def _fresh(self, request: ev.RequestSubmitted, delivered: int = 1) -> bool:
        """Not a duplicate submission, and not already ended (cancelled before admission).

        Cancels reach this process (its `conductor-cancel` consumer), so a request cancelled
        before its admission is known locally; the shared terminal bucket is read only where
        that memory may be incomplete: a redelivery, or the first moments after a restart."""
        if request.request_id in self._cancelled:
            return False
        check = delivered > 1 or self._clock() - self._started < TERMINAL_CHECK_AFTER_START_S
        # Its own rejection's claim is not an end: an attempt that claimed it and died (or
        # could not publish) before the rejection went out leaves it to this one to redo.
        redo = dispatch.decision_event_id(request)
        first, ended = await asyncio.gather(
            self._first_submission(request),
            terminal.ended(self._terminal, request.request_id, redo=redo) if check else _none(),
        )
        if not first:
            log.info("duplicate submission of %s ignored", request.request_id)
            return False
        if ended is not None:
            log.info("%s ended before admission (cancelled)", request.request_id)
            return False
        return True

    def _over_client_limit(
        self, request: ev.RequestSubmitted, d: Delivery
    ) -> ev.RequestRejected | None:
        """The rejection of a submission over its client's limit, or None. Only submissions
        that name a client count, each once: a redelivery was counted when it first came."""
        if request.client_id is None or d.num_delivered > 1:
            return None
        wait = self._client_limits.take(request.client_id, self._clock())
        if wait <= 0:
            return None
        limit = self._client_limit
        return ev.RequestRejected(
            event_id=dispatch.decision_event_id(request),
            request_id=request.request_id,
            reason=RejectReason.CLIENT_RATE_LIMITED,
            stage="ingress",
            detail=f"client {request.client_id} is over its limit of {limit.rate_per_s:g} "
            f"requests/s (burst {limit.burst:g}); retry in {wait:.2f} s",
            inputs={
                "client_id": request.client_id,
                "retry_after_s": round(wait, 3),
                "client_rate_per_s": limit.rate_per_s,
                "client_burst": limit.burst,
            },
        )

    def _plan(self, request: ev.RequestSubmitted, d: Delivery) -> Plan:
        """The decision (pure, in arrival order: it updates the view)."""
        if (limited := self._over_client_limit(request, d)) is not None:
            return (limited, "ingress")
        tokens = self._prompt_tokens(request)
        if isinstance(tokens, str):
            return (dispatch.invalid_event(request, tokens), "admission")
        if self._context is not None:
            params = request.params
            fit = ingress.fit_context(
                len(tokens), params.max_tokens, self._context,
                max_tokens_given="max_tokens" in params.model_fields_set,
            )  # fmt: skip
            if isinstance(fit, tuple):
                return (dispatch.invalid_event(request, fit[1], fit[0]), "admission")
            if fit != params.max_tokens:
                request = request.model_copy(
                    update={"params": params.model_copy(update={"max_tokens": fit})}
                )
        s = self._ctx.settings
        namespace = dispatch.namespace_of(request, s.shared_cache)
        keys = request_keys(
            tokens, s.block_tokens, seed=s.hash_seed, model_id=s.model_id, namespace=namespace
        )
        sreq = cd.ScheduleRequest(request.request_id, len(tokens), tuple(keys), request.tenant)
        now = self._clock()
        decision = admission.decide(self._policy, self.view, sreq, self._cfg, self._costs, now)
        online = self._online
        if self._policy != "none" and online is not None and not online.prefill_calibrated:
            decision = admission.while_calibrating(decision, self.view, now)
        why = None
        if decision.reason is RejectReason.NO_INSTANCE:
            why = self._no_instance_why(len(tokens))
            delay = dispatch.no_instance_delay(
                d.num_delivered, s.conductor.no_instance_wait_s, s.bus.max_deliver
            )
            if delay is not None:
                return Retry(why, delay)
        inputs = self._inputs(request, decision)
        if not decision.admitted:
            return (dispatch.rejected_event(request, decision, inputs, why), decision.stage)
        admitted = dispatch.admitted_event(request, decision, inputs)
        calibrated = online is None or online.prefill_calibrated
        fact = cd.assignment(decision, sampled=calibrated)
        if fact is not None:
            self.view.apply(fact, now)
        metrics.TTFT_MARGIN.set(cd.ttft_margin(self.view, self._cfg))
        self.known.add(request.request_id, Known(request.reply_to, admitted.event_id))
        work = dispatch.prefill_work(
            request, decision, tokens, admitted.event_id, s.block_tokens, namespace,
            self._costs.prefill.prefill_s, self._cfg.cpp.chunk_tokens,
        )  # fmt: skip
        return (admitted, work)

    def _no_instance_why(self, prompt_tokens: int) -> str:
        """Why no instance could take a request (the `no_instance` detail)."""
        prefill = len(self.liveness.alive("prefill"))
        decode = len(self.liveness.alive("decode"))
        if prefill and decode:
            return (
                f"no live decode instance's KV pool can hold a prompt of {prompt_tokens:,} "
                f"tokens (live: {prefill} prefill, {decode} decode)"
            )
        waited = self._ctx.settings.conductor.no_instance_wait_s
        return (
            f"no live {'decode' if prefill else 'prefill'} instance (live: {prefill} prefill, "
            f"{decode} decode; waited {waited:g} s for one)"
        )

    async def handle_batch(self, batch: list[Delivery]) -> list[Outcome]:
        """A batch of submissions: the I/O of different requests overlaps (dedupe and
        terminal lookups, then the publishes), the decisions stay one at a time in arrival
        order. One consumer span per message, as `per_message` makes."""
        spans = [consumer_span("admit", d) for d in batch]
        outcomes: list[Outcome] = [ACK] * len(batch)
        try:

            async def pre(i: int) -> ev.RequestSubmitted | None:
                with trace.use_span(spans[i], end_on_exit=False):
                    judged = self._judge(batch[i])
                    if isinstance(judged, ev.RequestSubmitted):
                        spans[i].set_attribute("mc.tenant", judged.tenant)
                        fresh = await self._fresh(judged, batch[i].num_delivered)
                        return judged if fresh else None
                    outcomes[i] = await judged
                    return None

            fresh = await asyncio.gather(
                *(pre(i) for i in range(len(batch))), return_exceptions=True
            )
            plans: dict[int, tuple[ev.RequestSubmitted, Plan]] = {}
            for i, req in enumerate(fresh):
                if isinstance(req, BaseException):
                    outcomes[i] = _failed(spans[i], req)
                elif req is not None:
                    with trace.use_span(spans[i], end_on_exit=False):
                        try:
                            plans[i] = (req, self._plan(req, batch[i]))
                        except Exception as exc:
                            outcomes[i] = _failed(spans[i], exc)

            redelivered = {i for i, d in enumerate(batch) if d.num_delivered > 1}
            await self._claim_rejections(plans, spans, outcomes, redelivered)
            await self._emit_batch(plans, spans, outcomes, redelivered)
            return outcomes
        finally:
            for span in spans:
                span.end()

    async def _claim_rejections(
        self,
        plans: dict[int, tuple[ev.RequestSubmitted, Plan]],
        spans: list[trace.Span],
        outcomes: list[Outcome],
        redelivered: set[int],
    ) -> None:
        """A rejection ends its request: its terminal slot is claimed before it is published
        (`Ender.claim_rejections`), and one whose request ended first (a cancel) is dropped.
        A redelivered submission's rejection is claimed after the publish instead: an earlier
        attempt may have stored an admission whose work is out, which a claim made first
        would end (`_emit_batch` adopts that admission)."""
        firsts = [
            (i, plan[0])
            for i, (_, plan) in plans.items()
            if i not in redelivered
            and not isinstance(plan, Retry)
            and isinstance(plan[0], ev.RequestRejected)
        ]
        if not firsts:
            return
        claimed = await self.ender.claim_rejections([event for _, event in firsts])
        for (i, event), won in zip(firsts, claimed, strict=True):
            if won is True:
                continue
            if isinstance(won, BaseException):
                outcomes[i] = _failed(spans[i], won)
            else:
                log.info("%s ended before its rejection (cancelled)", event.request_id)
            del plans[i]

    async def _emit_batch(
        self,
        plans: dict[int, tuple[ev.RequestSubmitted, Plan]],
        spans: list[trace.Span],
        outcomes: list[Outcome],
        redelivered: set[int],
    ) -> None:
        """Publish the decisions of a batch, pipelined (`Publisher.publish_batch`): first
        every decision event, then the work of those admitted (an admission is recorded
        before its work exists), then the replies. A message that cannot be published
        leaves its submission to be retried; the others go on."""
        pub = self._ctx.publisher
        decided: list[tuple[int, ev.RequestSubmitted, ev.RequestAdmitted | ev.RequestRejected]] = []
        works: dict[int, PrefillWork] = {}
        stages: dict[int, str] = {}
        items = []
        for i, (request, plan) in plans.items():
            if isinstance(plan, Retry):
                outcomes[i] = plan
                continue
            first, second = plan
            if isinstance(second, PrefillWork):
                works[i] = second
            else:
                stages[i] = second
            with trace.use_span(spans[i], end_on_exit=False):
                items.append(pub.prepare(first))
            decided.append((i, request, first))
        results = await pub.publish_batch(items)
        await self._adopt_stored(decided, results, works, stages)
        work_items: list[tuple[str, bytes, dict[str, str]]] = []
        work_of: list[tuple[int, ev.RequestSubmitted, ev.RequestAdmitted] | None] = []
        for (i, request, event), result in zip(decided, results, strict=True):
            if isinstance(result, BaseException):
                outcomes[i] = _failed(spans[i], result)
                continue
            pub.count(event.type)
            if i in works:
                work = works[i]
                headers = {MSG_ID: dispatch.prefill_work_msg_id(request)}
                with trace.use_span(spans[i], end_on_exit=False):
                    inject_headers(headers)  # the trace continues on the prefill instance
                subject = self._subjects.prefill(work.prefill_instance)
                work_items.append((subject, work.to_json(), headers))
                assert isinstance(event, ev.RequestAdmitted)
                work_of.append((i, request, event))
                # A CPP group's other stages right after it: each queue in decision order.
                for stage in dispatch.stage_works(work):
                    assert stage.cpp is not None
                    member = stage.cpp.group[stage.cpp.stage]
                    sh = {**headers, MSG_ID: dispatch.stage_work_msg_id(request, stage.cpp.stage)}
                    work_items.append((self._subjects.prefill(member), stage.to_json(), sh))
                    work_of.append(None)
            else:
                assert isinstance(event, ev.RequestRejected)
                if i in redelivered and not await self.ender.claim_rejection(event):
                    log.warning("%s was rejected after it ended", request.request_id)
                metrics.REQUESTS_REJECTED.labels(stages[i], event.reason.value).inc()
                await self._reply(request, event)
        sent = await pub.publish_batch(work_items)
        for of, result in zip(work_of, sent, strict=True):
            if of is None:  # a CPP stage's work: one not sent leaves its leader alone
                if isinstance(result, BaseException):
                    log.warning("a CPP stage's work was not sent: %s", result)
                continue
            i, request, admitted = of
            if isinstance(result, BaseException):
                outcomes[i] = _failed(spans[i], result)
                continue
            metrics.REQUESTS_ADMITTED.labels(admitted.policy).inc()
            await self._reply(request, admitted)

    async def _adopt_stored(
        self,
        decided: list[tuple[int, ev.RequestSubmitted, ev.RequestAdmitted | ev.RequestRejected]],
        results: list[PubAck | BaseException],
        works: dict[int, PrefillWork],
        stages: dict[int, str],
    ) -> None:
        """Where the broker already held a decision of the submission (its ack says
        duplicate), that decision stands, not the one just made: read it back (the ack names
        its stream place) and act on it (`conductor_dispatch`'s doc says when this happens)."""
        dups = [(k, r) for k, r in enumerate(results) if isinstance(r, PubAck) and r.duplicate]
        if not dups:
            return
        stored = await asyncio.gather(
            *(self._stored_decision(ack, decided[k][1]) for k, ack in dups),
            return_exceptions=True,
        )
        now = self._clock()
        for (k, _), kept in zip(dups, stored, strict=True):
            i, request, ours = decided[k]
            if isinstance(kept, BaseException):
                results[k] = kept  # the submission is retried
                continue
            if dispatch.same_decision(kept, ours):
                continue
            log.warning(
                "%s was decided before (%s); that decision stands, not this one (%s)",
                request.request_id, kept.type, ours.type,
            )  # fmt: skip
            decided[k] = (i, request, kept)
            if isinstance(ours, ev.RequestAdmitted):  # undo what planning it applied
                self.view.apply(cl.RequestDropped(request.request_id), now)
                self.known.forget(request.request_id)
                works.pop(i, None)
            if isinstance(kept, ev.RequestAdmitted):
                tokens = self._prompt_tokens(request)
                assert not isinstance(tokens, str), tokens  # an admitted prompt was valid
                s = self._ctx.settings
                works[i] = dispatch.prefill_work_of_admission(
                    request, kept, tokens, s.block_tokens,
                    dispatch.namespace_of(request, s.shared_cache),
                )  # fmt: skip
                self.known.add(request.request_id, Known(request.reply_to, kept.event_id))
                stages.pop(i, None)
            else:
                stages[i] = kept.stage

    async def _stored_decision(
        self, ack: PubAck, request: ev.RequestSubmitted
    ) -> ev.RequestAdmitted | ev.RequestRejected:
        msg = await self._ctx.js.get_msg(ack.stream, ack.seq)
        kept = ev.parse_event(msg.data or b"", subject=self._ctx.ns.canonical(msg.subject or ""))
        if (
            not isinstance(kept, ev.RequestAdmitted | ev.RequestRejected)
            or kept.request_id != request.request_id
        ):
            raise RuntimeError(f"{ack.stream} seq {ack.seq} is not a decision of this request")
        return kept

    async def _reply(self, request: ev.RequestSubmitted, event: ev.Event) -> None:
        """The decision to the client too (core NATS: best effort, the record has it)."""
        await reply(self._ctx.nc, request.reply_to, event.to_json())

    def _judge(self, d: Delivery) -> ev.RequestSubmitted | Awaitable[Outcome]:
        """The accepted request, or (an awaitable of) the outcome of one that is not."""
        parsed = ev.parse_event(
            d.data,
            subject=self._ctx.ns.canonical(d.subject),
            max_bytes=self._ctx.settings.bus.max_event_bytes,
        )
        decision = ingress.judge(
            parsed, msg_id=d.headers.get(MSG_ID), now=ev.utcnow(), reserved=self._reserved
        )
        match decision:
            case ingress.Accept(request=request):
                return request
            case _:
                return self._not_accepted(decision)

    async def _not_accepted(self, decision: ingress.Reject | ingress.Discard) -> Outcome:
        match decision:
            case ingress.Discard(reason=reason, detail=detail):
                metrics.REQUESTS_REJECTED.labels("ingress", "unreadable").inc()
                return DeadLetter(reason, detail)
            case ingress.Reject(event=rejected, reply_to=reply_to):
                if await self.ender.reject(rejected, reply_to=reply_to):
                    metrics.REQUESTS_REJECTED.labels("ingress", rejected.reason.value).inc()
                return ACK
        raise AssertionError("unreachable")  # pragma: no cover

    def _inputs(self, request: ev.RequestSubmitted, decision: cd.Decision) -> dict[str, Any]:
        """Every input of the decision (the event log explains it afterwards)."""
        return {
            **decision.to_dict(),
            "slo_class": request.slo_class,
            "prompt_source": "token_ids" if request.token_ids is not None else "text",
            # What it may generate: the client's max_tokens, or a default cut to the context.
            "max_tokens": request.params.max_tokens,
            "instances_alive": {
                "prefill": self.liveness.alive("prefill"),
                "decode": self.liveness.alive("decode"),
            },
            # The predictor as it stood: refits, samples, fitted or seed, latest error.
            **({"cost_model": self._online.state()} if self._online is not None else {}),
            # The KV index it read: every node's blocks counted as hits, but those listed
            # here (not EXACT: store/kv_index.py), whose blocks it counted as unknown.
            "kv_index": {
                "unsure_nodes": sorted(self.view.unsure_nodes),
                "unsure_instances": sorted(self.view.unsure_instances),
                # ... and the state each of those was in (resyncing, degraded): store nodes
                # and engine tiers apart (a worker's node and its engine share its id).
                "node_states": _not_exact(self.feed.kv.states),
                "instance_states": _not_exact(self.feed.engine_kv.states),
            },
        }

    async def cancel(self, d: Delivery) -> Outcome:
        event = ev.parse_event(d.data, subject=self._ctx.ns.canonical(d.subject))
        if not isinstance(event, ev.CancelRequested):
            detail = event.detail if isinstance(event, ev.InvalidEvent) else event.type
            return DeadLetter("invalid_request", detail)
        self._cancelled[event.request_id] = None
        while len(self._cancelled) > CANCELLED_MEMORY:
            self._cancelled.popitem(last=False)
        known = self.known.get(event.request_id)
        stage = cancel_stage(self.view, event.request_id, known is not None)
        reply_to = known.reply_to if known is not None else None
        eid = cancelled_event_id(event.event_id)
        rid = event.request_id
        if await self.ender.cancel(rid, eid, reason=event.reason, stage=stage, reply_to=reply_to):
            metrics.REQUESTS_ENDED_BY_CONDUCTOR.labels("cancelled", "requested").inc()
            log.info("request %s cancelled at %s", rid, stage)
        self.view.apply(cl.RequestDropped(event.request_id), self._clock())
        return ACK

    async def start(self) -> None:
        await self.feed.start()
        await self.read_back.start()
        self.sweep.start()

    async def stop(self) -> None:
        await self.sweep.stop()
        await self.read_back.stop()
        await self.feed.stop()
        await self.reaper.stop()


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


async def start_conductor(ctx: WorkerContext) -> Conductor:
    """The Conductor with its cost model, tokenizer and buckets, following the cluster."""
    s = ctx.settings
    try:
        model: ModelHeader | None = await asyncio.to_thread(model_header, s.engine)
    except Exception:
        log.exception(
            "cannot read the model %s: text prompts will be rejected, and prompts too long "
            "for its context only at prefill", s.engine.model,
        )  # fmt: skip
        model = None
    # A bad profile stops the Conductor here, before any decision.
    costs = build_costs(s, model.spec.hidden if model is not None else None)
    terminal_kv = await terminal.open_bucket(ctx.js, ctx.ns, s.bus.replicas)
    conductor = Conductor(ctx, await open_request_ids(ctx), terminal_kv, model, costs)
    await conductor.start()
    return conductor


async def serve(ctx: WorkerContext, conductor: Conductor) -> None:
    """Take submissions and cancels until `ctx.stop` is set."""
    s = ctx.settings
    submitted = PullConsumer(ctx.nc, ctx.js, SUBMITTED, s.bus, ctx.ns)
    cancels = PullConsumer(ctx.nc, ctx.js, CANCELS, s.bus, ctx.ns)
    try:
        await asyncio.gather(
            submitted.run(conductor.handle_batch, ctx.stop),
            cancels.run(per_message(conductor.cancel, "cancel"), ctx.stop),
        )
    finally:
        with contextlib.suppress(Exception):
            await conductor.stop()


async def run(ctx: WorkerContext) -> None:
    await serve(ctx, await start_conductor(ctx))


async def main(settings: Settings, instance_id: str | None = None) -> None:
    async with worker_context(settings, "conductor", instance_id) as ctx:
        await run(ctx)


if __name__ == "__main__":
    from mooncake.config import load_settings

    s = load_settings()
    configure_logging(s.log_level)
    asyncio.run(main(s))

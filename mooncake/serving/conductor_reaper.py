"""Failure recovery: the work a dead instance held goes to a live one, or the request fails.

An instance takes work from its own durable consumer (`prefill-<id>` on `mc.prefill.<id>`,
`decode-<id>` on `mc.decode.<id>`, stream MC_WORK) and acks it when the effect is durable.
When the Conductor declares it dead (`LiveFeed`), the reaper binds to that consumer and pulls
whatever it left: messages never delivered come at once, the ones it held unacked once their
ack_wait runs out, and work sent to it later (a live prefill hands a request over to the
decode instance it was given at admission, however long the request queued). Each is
dispatched again to a live instance of the same role that the core chooses (`attempt + 1`, a
message id derived from the attempt), and only then acked; past `max_attempts` the request
fails (`retries_exhausted`). Work of a request that already ended (cancelled, say) is
dropped. While no live instance of the role can take a message, the reaper keeps it
(`in_progress`, which spends no delivery) and tries again each second, for at most
`conductor.no_instance_wait_s`, then fails the request (`no_instance`); if the instance comes
back meanwhile, what the reaper kept goes back to it at once, one delivery spent (a nak per
try would spend the instance's `bus.max_deliver` in as many seconds, and the work would
fail as exhausted the moment its owner returned).

The reaper stops when the consumer is drained and no request in flight names the instance
any more, or at once when the instance reports again (it is alive after all and takes its
own work back).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from pydantic import ValidationError

from mooncake import events as ev
from mooncake import metrics
from mooncake.aio import cancel_all
from mooncake.bus import terminal
from mooncake.bus.consume import ConsumerSpec, PullConsumer
from mooncake.bus.publish import MSG_ID
from mooncake.config import Settings
from mooncake.core import cluster as cl
from mooncake.core import conductor as cd
from mooncake.core.cost_model import Costs
from mooncake.hashing import request_keys
from mooncake.serving.conductor_dispatch import redispatch_msg_id
from mooncake.serving.conductor_feed import Member
from mooncake.serving.conductor_terminal import failed_event_id
from mooncake.serving.ending import Ender
from mooncake.work import DecodeWork, PrefillWork, WorkSubjects, completed_event_id

log = logging.getLogger("mooncake.conductor.reaper")
TRACE_HEADERS = ("traceparent", "tracestate")

Role = Literal["prefill", "decode"]
Work = PrefillWork | DecodeWork
# Messages the reaper pulls at once (what it holds of them counts in the Conductor's bound).
REAP_FETCH = 16
# How often (at most) the reaper tries again the work no live instance could take.
PARKED_RETRY_S = 1.0


@dataclass(slots=True)
class Parked:
    """A dead instance's message the reaper keeps while no live instance can take it."""

    msg: Msg
    since: float  # when no instance could first take it


def work_consumer(role: Role, instance: str) -> ConsumerSpec:
    """The durable consumer an instance takes its work from (canonical names)."""
    return ConsumerSpec("MC_WORK", f"{role}-{instance}", f"mc.{role}.{instance}")


def parse_work(role: Role, data: bytes) -> Work | None:
    try:
        if role == "prefill":
            return PrefillWork.model_validate_json(data)
        return DecodeWork.model_validate_json(data)
    except ValidationError:
        return None


class Reaper:
    def __init__(
        self,
        nc: NATS,
        js: JetStreamContext,
        settings: Settings,
        view: cl.ClusterView,
        cfg: cd.ConductorConfig,
        costs: Costs,
        ender: Ender,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.nc, self.js, self.settings = nc, js, settings
        self.ns = ev.Namespace(settings.namespace)
        self.subjects = WorkSubjects(self.ns)
        self.view, self.cfg, self.costs, self.ender = view, cfg, costs, ender
        self._clock = clock
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._stopping: set[asyncio.Task[int]] = set()  # reapers of revived instances

    def watch(self, member: Member) -> None:
        """Start reaping a dead instance's work (idempotent)."""
        if member.instance in self._tasks:
            return
        task = asyncio.create_task(self._reap(member), name=f"reap-{member.instance}")
        self._tasks[member.instance] = task
        task.add_done_callback(functools.partial(self._done, member.instance))

    def _done(self, instance: str, task: asyncio.Task[None]) -> None:
        if self._tasks.get(instance) is task:
            del self._tasks[instance]

    def revived(self, instance: str) -> None:
        """The instance reports again: it takes its own work back."""
        task = self._tasks.get(instance)
        if task is not None:
            log.info("%s reports again: reaping stops", instance)
            # Until it stops: a cancel its fetch swallowed would leave it taking the work of
            # an instance that pulls its own again.
            stopping = asyncio.create_task(cancel_all([task]))
            self._stopping.add(stopping)
            stopping.add_done_callback(self._stopping.discard)

    async def stop(self) -> None:
        await cancel_all([*self._tasks.values(), *self._stopping])

    # --- the loop over one dead instance's consumer ----------------------------------------

    async def _bind(self, role: Role, instance: str) -> JetStreamContext.PullSubscription:
        spec = work_consumer(role, instance).within(self.ns)
        try:
            await self.js.consumer_info(spec.stream, spec.durable)
        except NotFoundError:
            # It died before making its consumer: make it as the worker would, so work sent
            # to it meanwhile can be pulled (one consumer per subject on a work queue).
            pc = PullConsumer(
                self.nc, self.js, work_consumer(role, instance), self.settings.bus, self.ns,
                batch=1,
            )  # fmt: skip
            await pc.ensure()
        return await self.js.pull_subscribe_bind(durable=spec.durable, stream=spec.stream)

    async def _reap(self, member: Member) -> None:
        role, instance = member.role, member.instance
        try:
            psub = await self._bind(role, instance)
        except Exception:
            log.exception("cannot bind to %s's work consumer", instance)
            return
        bus = self.settings.bus
        # Held messages come back one ack_wait after their last delivery (or in_progress).
        linger = 2 * bus.ack_wait_s + self.settings.conductor.liveness_timeout_s
        idle_since = self._clock()
        parked: dict[tuple[str, int], Parked] = {}  # no live instance took them yet
        tried = idle_since
        retry_s = min(PARKED_RETRY_S, bus.ack_wait_s / 3)  # in_progress well within ack_wait
        log.info("reaping %s work of dead instance %s", role, instance)
        try:
            while True:
                try:
                    msgs = await psub.fetch(REAP_FETCH, timeout=retry_s)
                except (TimeoutError, nats.errors.TimeoutError):
                    msgs = []
                for m in msgs:
                    await self._one(role, m, parked)
                now = self._clock()
                if parked and now - tried >= retry_s:
                    tried = now
                    for p in list(parked.values()):
                        await self._one(role, p.msg, parked)
                if msgs:
                    idle_since = now
                elif now - idle_since > linger:
                    info = await psub.consumer_info()
                    drained = info.num_pending == 0 and info.num_ack_pending == 0
                    if drained and not self.view.bound_to(instance):
                        log.info("%s's work is all re-dispatched", instance)
                        return
                    idle_since = now
        finally:
            # Given back at once (its owner is back, or the Conductor stops): the next to
            # pull the consumer takes them with one more delivery, not after an ack_wait.
            for p in parked.values():
                with contextlib.suppress(Exception):
                    await p.msg.nak()
            with contextlib.suppress(Exception):
                await psub.unsubscribe()

    async def _one(self, role: Role, m: Msg, parked: dict[tuple[str, int], Parked]) -> None:
        key = _msg_key(m)
        try:
            if await self._redispatch(role, m):
                parked.pop(key, None)
                return
        except Exception:
            parked.pop(key, None)
            log.exception("re-dispatch of %s failed; it comes back after ack_wait", m.subject)
            return
        # No live instance of the role: keep it (no delivery spent), fail it past the wait.
        p = parked.get(key)
        if p is None:
            p = parked[key] = Parked(m, self._clock())
        p.msg = m  # the newest delivery, if the server sent it again meanwhile
        if self._clock() - p.since > self.settings.conductor.no_instance_wait_s:
            parked.pop(key, None)
            work = parse_work(role, m.data)
            assert work is not None  # _redispatch read it
            await self._fail(role, work, "no_instance", f"no live {role} instance")
            await m.ack()
            return
        await m.in_progress()

    async def _redispatch(self, role: Role, m: Msg) -> bool:
        """Settle one of the dead instance's messages: True, or False while no live instance
        of the role can take it (the message is left as it is)."""
        work = parse_work(role, m.data)
        if work is None:
            log.error("unreadable %s work on %s dropped", role, m.subject)
            await m.term()
            return True
        rid = work.request_id
        # A completion the dead instance claimed may not be published: that work is done again
        # (the new attempt wins the same claim and publishes the same event).
        redo = completed_event_id(work.admitted_event_id, role)
        if (how := await terminal.ended(self.ender.kv, rid, redo=redo)) is not None:
            await m.ack()  # cancelled (or otherwise ended) meanwhile: nothing to do
            self.view.apply(cl.RequestDropped(rid), self._clock())
            log.info("%s work of %s not re-dispatched: it ended (%s)", role, rid, how)
            return True
        if isinstance(work, PrefillWork) and work.cpp is not None and work.cpp.stage > 0:
            # A CPP stage is its leader's to replace: the leader gives the group up when a
            # member goes silent and prefills the request alone.
            await m.ack()
            log.info("stage %d of %s's group not re-dispatched", work.cpp.stage, rid)
            return True
        attempt = work.attempt + 1
        if attempt > self.settings.conductor.max_attempts:
            await self._fail(role, work, "retries_exhausted", f"{work.attempt} attempts")
            await m.ack()
            return True
        old_id = (m.headers or {}).get(MSG_ID) or "{}:{}".format(*_msg_key(m))
        trace = {k: v for k, v in (m.headers or {}).items() if k in TRACE_HEADERS}
        sent = await self._send(role, work, attempt, redispatch_msg_id(old_id, attempt), trace)
        if sent is None:
            return False
        await m.ack()
        metrics.WORK_REDISPATCHED.labels(role).inc()
        log.info("%s work of %s re-dispatched to %s (attempt %d)", role, rid, sent, attempt)
        return True

    async def _send(
        self, role: Role, work: Work, attempt: int, msg_id: str, trace: dict[str, str]
    ) -> str | None:
        """Publish the work again to a live instance; the instance, or None if none is."""
        now = self._clock()
        if isinstance(work, PrefillWork):
            keys = request_keys(
                work.token_ids, self.settings.block_tokens, seed=self.settings.hash_seed,
                model_id=self.settings.model_id, namespace=work.cache_namespace,
            )  # fmt: skip
            req = cd.ScheduleRequest(work.request_id, len(work.token_ids), tuple(keys), work.tenant)
            choice = cd.choose(self.view, req, self.cfg, self.costs, now)
            if choice is None:
                return None
            decode = work.decode_instance
            if decode not in self.view.decode:
                decode = choice.decode.id
            cached = choice.prefix_tokens // self.cfg.block_tokens
            new: Work = work.model_copy(
                update={
                    "attempt": attempt, "prefill_instance": choice.prefill.id,
                    "decode_instance": decode, "cached_blocks": cached,
                    "local_blocks": min(choice.local_blocks, cached),
                    "load_limit_blocks": choice.load_limit_blocks,
                    "cpp": None,  # a dead leader's group is gone: one instance prefills it
                }
            )  # fmt: skip
            target, subject = choice.prefill.id, self.subjects.prefill(choice.prefill.id)
            # The queue-time update of Algorithm 1, on the instance that now has the work.
            self.view.apply(cl.RequestDropped(work.request_id), now)
            self.view.apply(
                cl.Assigned(
                    work.request_id, choice.prefill.id, decode, len(work.token_ids),
                    choice.prefill_s, choice.ttft_s, tenant=work.tenant,
                ),
                now,
            )  # fmt: skip
        else:
            d = cd.choose_decode(self.view, len(work.token_ids), self.costs)
            if d is None:
                return None
            new = work.model_copy(update={"attempt": attempt, "decode_instance": d.id})
            target, subject = d.id, self.subjects.decode(d.id)
            self.view.apply(cl.RequestDropped(work.request_id), now)
        # The request's trace goes on with the re-dispatched work.
        await self.js.publish(subject, new.to_json(), headers={MSG_ID: msg_id, **trace})
        return target

    async def _fail(self, role: Role, work: Work, reason: str, detail: str) -> None:
        ended = await self.ender.fail(
            work.request_id,
            failed_event_id(work.admitted_event_id, role),
            reason=reason,
            stage=role,
            detail=detail,
            reply_to=work.reply_to,
        )
        if ended:  # the Ender logs why
            metrics.REQUESTS_ENDED_BY_CONDUCTOR.labels("failed", reason).inc()
        self.view.apply(cl.RequestDropped(work.request_id), self._clock())


def _msg_key(m: Msg) -> tuple[str, int]:
    meta = m.metadata
    return (str(meta.stream), int(meta.sequence.stream))

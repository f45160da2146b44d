"""A small client: submit a request and follow what comes back on its reply subject.

What arrives on the reply subject: the Conductor's decision (`request.admitted` or
`request.rejected`, JSON events with a `type`), then the streamed tokens as `TokenChunk`s
(`index`, `token_ids`, `text`; the last one has `done` and the finish reason). Token index 0
comes from the prefill instance (the request's first token), the rest from decode. A decode
that was redelivered to another instance streams again from index 1: chunks are
deduplicated by index. Live chunks travel on core NATS (at most once): `ask` reads any a
finished request missed back from the request's copy on MC_TOKENS.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client as NATS

from mooncake import events as ev
from mooncake.aio import cancel_all
from mooncake.bus.consume import ConsumerSpec
from mooncake.bus.publish import Publisher
from mooncake.hashing import DEFAULT_TENANT

log = logging.getLogger("mooncake.client")

TERMINAL_TYPES = frozenset(
    {"request.rejected", "request.completed", "request.failed", "request.cancelled"}
)


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:16]}"


# What `submit(quiet_s=...)` yields after a quiet stretch (never a message of the system's).
QUIET: dict[str, Any] = {"quiet": True}
# `ask` looks in the request's replayable copy after this long without a live message: core
# NATS drops what is published while a client reconnects (a broker node lost or restarted),
# the final chunk included, and the copy holds it.
QUIET_S = 5.0
# How long a read-back rides out a broker failing over (consumer creation refused or timing
# out while the stream elects a leader).
READ_BACK_WITHIN_S = 20.0


def is_final(body: dict[str, Any], until: frozenset[str]) -> bool:
    """The reply that ends a request as far as its client is concerned."""
    return bool(body.get("done")) or body.get("type") in until


async def submit(
    nc: NATS,
    prompt: str | None = None,
    *,
    ns: ev.Namespace | None = None,
    token_ids: list[int] | None = None,
    params: ev.SamplingParams | None = None,
    request_id: str | None = None,
    timeout_s: float = 30.0,
    deadline_s: float | None = None,
    until: frozenset[str] = TERMINAL_TYPES,
    client_id: str | None = None,
    publisher: Publisher | None = None,
    quiet_s: float | None = None,
    reply_to: str | None = None,
    tenant: str = DEFAULT_TENANT,
    cache_namespace: str | None = None,
) -> AsyncGenerator[dict[str, Any], None]:
    """Publish one request and yield each message that comes back (decision events and
    token chunks), until the last chunk, a terminal decision in `until`, or the timeout.

    `client_id` names the end client (the gateway's API key digest) for per-client limits;
    `publisher` reuses a long-lived one (a worker's). With `quiet_s`, a stretch that long
    without a message yields `QUIET` (the caller may look in the replayable copy).
    `reply_to`: the inbox to use (a new one by default); a read-back names it. `tenant`:
    whose request it is (tenants share no cached KV); `cache_namespace`: a shared cache
    namespace to key its blocks in instead of the tenant's own."""
    request_id = request_id or new_request_id()
    inbox = reply_to or nc.new_inbox()
    sub = await nc.subscribe(inbox)
    try:
        event = ev.RequestSubmitted(
            request_id=request_id,
            prompt=prompt,
            token_ids=token_ids,
            params=params or ev.SamplingParams(),
            reply_to=inbox,
            deadline_s=deadline_s,
            client_id=client_id,
            tenant=tenant,
            cache_namespace=cache_namespace,
        )
        await (publisher or Publisher(nc, nc.jetstream(), ns or ev.Namespace())).publish(event)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (remaining := deadline - loop.time()) > 0:
            wait = remaining if quiet_s is None else min(remaining, quiet_s)
            try:
                msg = await sub.next_msg(timeout=wait)
            except TimeoutError:
                if wait < remaining:
                    yield QUIET
                    continue
                break
            try:
                body = json.loads(msg.data)
            except ValueError:
                continue
            if not isinstance(body, dict):
                continue
            yield body
            if is_final(body, until):
                return
    finally:
        await sub.unsubscribe()


@dataclass
class Outcome:
    """What a client saw of one request."""

    request_id: str
    decision: dict[str, Any] | None = None
    tokens: dict[int, int] = field(default_factory=dict)  # index -> token id
    text_parts: dict[int, str] = field(default_factory=dict)
    finish_reason: str | None = None
    error: str | None = None
    submitted_at: float = 0.0
    first_token_at: float | None = None
    token_times: list[float] = field(default_factory=list)
    # The final chunk's index: how many tokens a finished request has (0 .. index - 1).
    final_index: int | None = None
    # Tokens that never arrived live (core NATS drops what is published while the client is
    # reconnecting, e.g. across a broker restart) and were read back from MC_TOKENS.
    repaired: int = 0
    # The request's reply subject: what proves to the read-back service that it is ours.
    reply_to: str | None = None

    @property
    def admitted(self) -> bool:
        return self.decision is not None and self.decision.get("type") == "request.admitted"

    @property
    def rejected_reason(self) -> str | None:
        d = self.decision
        if not d or d.get("type") != "request.rejected":
            return None
        return str(d.get("reason") or "")  # "" for a rejection that gave no reason

    @property
    def token_ids(self) -> list[int]:
        return [self.tokens[i] for i in sorted(self.tokens)]

    @property
    def text(self) -> str:
        return "".join(self.text_parts[i] for i in sorted(self.text_parts))

    @property
    def finished(self) -> bool:
        return self.finish_reason in ("stop", "length")

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.submitted_at

    @property
    def tbt_s(self) -> float | None:
        """Mean of the slowest 10 % of inter-token gaps, as FAST'25 scores TBT."""
        gaps = sorted(
            (b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)),
            reverse=True,
        )
        if not gaps:
            return None
        worst = gaps[: max(1, len(gaps) // 10)]
        return sum(worst) / len(worst)

    def take(self, body: dict[str, Any]) -> None:
        if "type" in body:
            if body["type"] in ("request.admitted", "request.rejected"):
                self.decision = body
            return
        now = time.monotonic()
        start = int(body.get("index", 0))
        for k, tok in enumerate(body.get("token_ids", [])):
            if start + k not in self.tokens:
                self.tokens[start + k] = int(tok)
                self.token_times.append(now)
                if self.first_token_at is None:
                    self.first_token_at = now
        if body.get("text") and start not in self.text_parts:
            self.text_parts[start] = str(body["text"])
        if body.get("done"):
            self.finish_reason = body.get("finish_reason")
            self.error = body.get("error")
            self.final_index = int(body.get("index", 0))

    def missing(self) -> list[int]:
        """Indexes of a finished request's tokens that did not arrive (none otherwise)."""
        if not self.finished or self.final_index is None:
            return []
        return [i for i in range(self.final_index) if i not in self.tokens]

    @property
    def incomplete(self) -> bool:
        """What the request's copy may complete: tokens a finished request missed, or the
        final chunk of one that began (admitted, or tokens seen) and never got it."""
        begun = self.admitted or bool(self.tokens)
        return bool(self.missing()) or (begun and self.finish_reason is None)

    def next_missing(self) -> int:
        """The first index this client lacks (where a read-back starts)."""
        return next(i for i in range(len(self.tokens) + 1) if i not in self.tokens)

    def fill(self, chunk: dict[str, Any]) -> None:
        """A token chunk read back after the fact: its tokens and text, without timings (and
        the end, from a final chunk the client never got live)."""
        if chunk.get("done") and self.finish_reason is None:
            self.finish_reason = chunk.get("finish_reason")
            self.error = chunk.get("error")
            self.final_index = int(chunk.get("index", 0))
        start = int(chunk.get("index", 0))
        for k, tok in enumerate(chunk.get("token_ids", [])):
            if start + k not in self.tokens:
                self.tokens[start + k] = int(tok)
                self.repaired += 1
        if chunk.get("text") and start not in self.text_parts:
            self.text_parts[start] = str(chunk["text"])


class Looks:
    """When a client whose live stream went quiet (`QUIET`) looks in the request's copy.

    Mid-answer a quiet stretch is a stall: look each time. Before the first token (a prefill
    queue may take minutes, or the decision was what got lost) after 3, 6, 12, ... stretches,
    so that a replay's queued requests do not each open a consumer every 5 s."""

    def __init__(self) -> None:
        self.quiet, self.next_look = 0, 3

    def due(self, mid_answer: bool) -> bool:
        self.quiet += 1
        if mid_answer or self.quiet >= self.next_look:
            self.next_look = self.next_look if mid_answer else 2 * self.quiet
            return True
        return False


async def ask(
    nc: NATS,
    prompt: str | None = None,
    *,
    ns: ev.Namespace | None = None,
    token_ids: list[int] | None = None,
    params: ev.SamplingParams | None = None,
    request_id: str | None = None,
    timeout_s: float = 120.0,
    deadline_s: float | None = None,
    tenant: str = DEFAULT_TENANT,
    cache_namespace: str | None = None,
) -> Outcome:
    """Submit and collect the whole outcome (decision, tokens, text, timings); `tenant` and
    `cache_namespace` as `submit` takes them."""
    rid = request_id or new_request_id()
    out = Outcome(rid, submitted_at=time.monotonic())
    ns = ns or ev.Namespace()
    looks, looking = Looks(), None
    replies = submit(
        nc, prompt, ns=ns, token_ids=token_ids, params=params, request_id=rid,
        timeout_s=timeout_s, deadline_s=deadline_s, quiet_s=QUIET_S, tenant=tenant,
        cache_namespace=cache_namespace,
    )  # fmt: skip
    try:
        async with contextlib.aclosing(replies):
            async for body in replies:
                if body is not QUIET:
                    out.take(body)
                elif looking is not None and looking.done() and looking.result():
                    break  # the copy ended it
                elif (looking is None or looking.done()) and looks.due(bool(out.tokens)):
                    # A look in the copy runs beside the live stream (whose timings it must
                    # not hold up).
                    looking = asyncio.create_task(_caught_up(nc, ns, out))
    finally:
        if looking is not None:
            await cancel_all([looking])
    if out.incomplete:
        try:
            await fill_from_copy(nc, ns, out)
        except Exception as exc:  # no JetStream access (a gateway-scoped user), an outage
            log.warning("%s: tokens %s not read back: %s", rid, out.missing(), exc)
    return out


async def _caught_up(nc: NATS, ns: ev.Namespace, out: Outcome) -> bool:
    """Whether the request's copy ended it for this client (a quick look: the live stream
    goes on otherwise)."""
    with contextlib.suppress(Exception):
        await fill_from_copy(nc, ns, out, idle_timeout_s=1.0, within_s=2.0)
    return out.finished and not out.missing()


class InOrderText:
    """Text of a request's token chunks, released in index order.

    Index 0 comes from the prefill instance and the rest from decode, two publishers whose
    messages may cross; `Outcome` keeps them by index, this hands out each piece once, only
    when every token before it has arrived (the rest at the end)."""

    def __init__(self, outcome: Outcome) -> None:
        self._out = outcome
        self._next = 0

    def release(self) -> str:
        parts = []
        while self._next in self._out.tokens:
            parts.append(self._out.text_parts.get(self._next, ""))
            self._next += 1
        return "".join(parts)

    def rest(self) -> str:
        parts = [t for i, t in sorted(self._out.text_parts.items()) if i >= self._next]
        self._next = max([self._next, *(i + 1 for i in self._out.text_parts)])
        return "".join(parts)


async def fill_from_copy(
    nc: NATS,
    ns: ev.Namespace,
    out: Outcome,
    idle_timeout_s: float = 5.0,
    within_s: float = READ_BACK_WITHIN_S,
) -> None:
    """Read what the client missed from the request's replayable copy on MC_TOKENS: tokens
    that did not arrive live (core NATS, at most once) and the final chunk if it never came.
    Without this a lost chunk silently shortens the answer while the final chunk says it is
    complete. A broker failing over is ridden out for `within_s`."""
    from mooncake.bus.publish import retry_transient  # the serving side, only when needed
    from mooncake.serving.streaming import resume_tokens

    async def read() -> None:
        async for chunk in resume_tokens(
            nc.jetstream(), ns, out.request_id, out.next_missing(), idle_timeout_s=idle_timeout_s
        ):
            out.fill(chunk.model_dump(mode="json"))
            if out.finished and not out.missing():
                return

    await retry_transient(read, within_s)


class ReadBackRefused(RuntimeError):
    """The read-back service would not answer the ask (its reason is the message)."""


async def read_back(
    nc: NATS,
    ns: ev.Namespace,
    out: Outcome,
    *,
    within_s: float = READ_BACK_WITHIN_S,
    ask_timeout_s: float = 5.0,
) -> None:
    """`fill_from_copy` for a client that may not read MC_TOKENS itself (the gateway): the
    same chunks through the read-back service (`serving.token_readback`), which answers only
    the request's submitter (`out.reply_to`). Asks again while the answer has `more`; rides
    out a broker failing over and a busy service for `within_s`."""
    from mooncake.bus.publish import retry_transient
    from mooncake.work import ReadBackAnswer, ReadBackAsk, WorkSubjects

    if out.reply_to is None:
        raise ReadBackRefused(f"{out.request_id}: no reply subject to prove it is ours")
    subject = WorkSubjects(ns).read_back()
    deadline = time.monotonic() + within_s

    async def ask_once(start: int) -> ReadBackAnswer:
        assert out.reply_to is not None
        ask = ReadBackAsk(request_id=out.request_id, reply_to=out.reply_to, from_index=start)
        msg = await nc.request(subject, ask.to_json(), timeout=ask_timeout_s)
        return ReadBackAnswer.model_validate_json(msg.data)

    while True:
        start = out.next_missing()
        left = max(0.0, deadline - time.monotonic())
        answer = await retry_transient(lambda: ask_once(start), left)  # noqa: B023
        if answer.retry and time.monotonic() + 0.2 < deadline:
            await asyncio.sleep(0.2)
            continue
        if answer.error is not None:
            raise ReadBackRefused(answer.error)
        for chunk in answer.chunks:
            out.fill(chunk.model_dump(mode="json"))
        if not answer.more or out.next_missing() == start:
            return


# The Conductor's durable consumer of submissions (canonical names; the worker makes it).
SUBMISSIONS = ConsumerSpec("MC_REQ", "conductor", ev.RequestSubmitted.SUBJECT)
BUSY_WITHIN_S = 10.0  # a delivery this recent means a Conductor is taking submissions


class SystemDown(RuntimeError):
    """No Conductor takes submissions: a request published now would wait in the stream
    for one (a later `mooncake up` would serve it), and its client would hear nothing."""


async def check_admitting(nc: NATS, ns: ev.Namespace, within_s: float = 3.0) -> None:
    """Return when a Conductor takes submissions in `ns`; SystemDown (saying why) if none
    does within `within_s`. Read from the Conductor's consumer: a waiting pull request (an
    idle Conductor always has one) or a delivery in the last `BUSY_WITHIN_S` (a busy one)."""
    from nats.js.errors import NotFoundError

    spec = SUBMISSIONS.within(ns)
    js = nc.jetstream()
    deadline = time.monotonic() + within_s
    while True:
        try:
            info = await js.consumer_info(spec.stream, spec.durable)
        except NotFoundError as exc:
            if time.monotonic() < deadline:  # a Conductor may be making it right now
                await asyncio.sleep(0.2)
                continue
            raise SystemDown(
                f"no Conductor has run in namespace {ns.prefix!r} on this broker (no "
                f"{spec.durable!r} consumer on {spec.stream}); start the system with "
                "`mooncake up`"
            ) from exc
        last = info.delivered.last_active if info.delivered is not None else None
        age = (time.time() - last.timestamp()) if last is not None else None
        if info.num_waiting > 0 or (age is not None and age < BUSY_WITHIN_S):
            return
        if time.monotonic() >= deadline:
            since = f"for {age:.0f} s" if age is not None else "ever"
            raise SystemDown(
                f"no Conductor is taking submissions in namespace {ns.prefix!r} (none has pulled "
                f"one {since}, {info.num_pending} waiting): is `mooncake up` running?"
            )
        await asyncio.sleep(0.2)

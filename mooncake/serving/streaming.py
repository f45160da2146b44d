"""Streaming a request's output tokens: to its client live, and to a replayable copy.

Live: every new token goes at once to the request's `reply_to` subject (core NATS) as one
`TokenChunk(index=i, token_ids=[t], text=delta)`; the last chunk has `done` and the finish
reason. Replayable: the same chunks, gathered per request (every `flush_s` or `flush_tokens`
tokens), go to `mc.tokens.<digest>` on the MC_TOKENS stream as one `TokenBatch` message, so
a client that lost its connection reads them back from any offset (`resume_tokens`).

A batch keeps the per-token chunks (rather than one merged chunk) so that a reader can start
exactly at any index, text included. Each message's `Nats-Msg-Id` is derived from the request
id and the indexes it holds, and full batches start at multiples of `flush_tokens`, so a
decode that is redelivered and streams the same tokens again mostly publishes the same ids
(dropped by the stream's dedupe window); readers dedupe by index anyway.

Text: `TextDeltas` turns tokens into text increments that never split a multi-byte character
(a token that ends inside one adds "" and the next one completes it) and hold back the last
characters that could still turn into a stop string. Index 0 comes from prefill with its whole
text (`sent_elsewhere`); decode streams the rest, so the increments concatenate to the
request's text.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy
from pydantic import ValidationError

from mooncake import events as ev
from mooncake import metrics
from mooncake.bus.publish import MSG_ID, Publisher, retry_transient
from mooncake.engine.tokenizer import ChatTokenizer
from mooncake.namespace import Namespace
from mooncake.work import TokenBatch, TokenChunk, WorkSubjects, owner_digest

log = logging.getLogger("mooncake.serving.streaming")

FLUSH_S = 0.05
FLUSH_TOKENS = 16
REPLACEMENT = "\ufffd"  # what a decoder yields for the bytes of an unfinished character


# --- text increments --------------------------------------------------------------------------


class TextDeltas:
    """Text increments of a token sequence (see the module docstring).

    Decoding re-reads a short window of recent tokens, not the whole output, so a step costs
    the same at token 10 and at token 10 000.
    """

    def __init__(self, tokenizer: ChatTokenizer | None, stop: Sequence[str] = ()) -> None:
        self._tok = tokenizer
        self._tokens: list[int] = []
        self._prefix = 0  # window start: tokens before it are already in `self.text`
        self._read = 0  # tokens up to here are decoded into `self.text`
        self.text = ""  # decoded so far (whole characters only)
        self.emitted = 0  # characters of `text` handed out
        self._stop = tuple(stop)
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._cut: int | None = None  # where a stop string begins: nothing past it goes out

    def push(self, token: int) -> str:
        """The text token `token` releases (often "" for a partial character)."""
        if self._tok is None:
            return ""
        self._tokens.append(token)
        before = self._tok.decode(self._tokens[self._prefix : self._read])
        after = self._tok.decode(self._tokens[self._prefix :])
        if after.endswith(REPLACEMENT) or not after.startswith(before):
            return ""  # inside a character: wait for the token that completes it
        self.text += after[len(before) :]
        self._prefix, self._read = self._read, len(self._tokens)
        if self._cut is None and self._stop:
            found = [i for st in self._stop if (i := self.text.find(st)) >= 0]
            self._cut = min(found) if found else None
        end = len(self.text) - self._hold if self._cut is None else self._cut
        end = max(end, self.emitted)
        delta, self.emitted = self.text[self.emitted : end], end
        return delta

    def sent_elsewhere(self, token: int) -> str:
        """Take `token` as streamed already, with all of its text (what prefill does with
        index 0: it sends `decode([token])` whole); returns that text."""
        if self._tok is None:
            return ""
        self.push(token)
        self.emitted = len(self.text)
        return self._tok.decode([token])

    def rest(self, final_text: str) -> str:
        """At the end: what `final_text` (the request's whole text) adds to what was
        handed out (held-back characters, or nothing when a stop string cut them)."""
        if len(final_text) <= self.emitted or not final_text.startswith(self.text[: self.emitted]):
            return ""
        tail = final_text[self.emitted :]
        self.emitted = len(final_text)
        return tail


# --- publishing -------------------------------------------------------------------------------


@dataclass
class _Stream:
    reply_to: str | None
    subject: str
    owner: str | None  # `owner_digest(reply_to)`, in every batch of the copy
    pending: list[TokenChunk] = field(default_factory=list)
    since: float = 0.0  # monotonic time the oldest pending chunk was added
    # One batch of a request in flight at a time: a batch that fails goes back in front of
    # the queue before the next one (the final one included) is cut, so the copy keeps
    # index order and never holds the `done` chunk ahead of tokens still to be stored.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def batch_msg_id(request_id: str, first: int, last: int) -> str:
    return f"tok:{request_id}:{first}:{last}"


# How long a request's final token batch is retried (the bus's backoff, `Publisher`) before
# the copy is declared incomplete: a broker node failing over takes seconds; a broker down
# for minutes is an outage the record has to say something about.
COPY_GIVE_UP_S = 120.0


class TokenStreamer:
    """The publisher side, shared by every request of one worker.

    `emit` sends a chunk to the client at once and queues its copy; `flush_due` publishes the
    copies whose batch is full or old (call it after every decode step); `close` sends the
    final chunk after the request's remaining copies.
    """

    def __init__(
        self,
        nc: NATS,
        js: JetStreamContext,
        ns: Namespace,
        *,
        instance: str = "unknown",
        flush_s: float = FLUSH_S,
        flush_tokens: int = FLUSH_TOKENS,
        give_up_s: float = COPY_GIVE_UP_S,
    ) -> None:
        self._nc, self._js = nc, js
        self._subjects = WorkSubjects(ns)
        self._instance = instance
        self._flush_s, self._flush_tokens = flush_s, flush_tokens
        self._streams: dict[str, _Stream] = {}
        self._final = Publisher(nc, js, ns, give_up_s=give_up_s)

    def open(self, request_id: str, reply_to: str | None) -> None:
        owner = owner_digest(reply_to) if reply_to else None
        self._streams[request_id] = _Stream(reply_to, self._subjects.tokens(request_id), owner)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams

    async def emit(self, chunk: TokenChunk, *, live: bool = True) -> None:
        """Send `chunk` to the client (unless `live` is False: it was sent already, e.g.
        index 0 by prefill) and queue its replayable copy."""
        s = self._streams.get(chunk.request_id)
        if s is None:
            return
        if live and s.reply_to:
            await self._nc.publish(s.reply_to, chunk.to_json())
        if not s.pending:
            s.since = time.monotonic()
        s.pending.append(chunk)
        last = chunk.index + len(chunk.token_ids)
        # Aligned: a redelivery cuts the same batch (unless one is in flight: then the next
        # flush takes these with it).
        if last % self._flush_tokens == 0 and not s.lock.locked():
            await self._publish(chunk.request_id, s)

    async def flush_due(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        due = [
            (rid, s)
            for rid, s in self._streams.items()
            if s.pending and now - s.since >= self._flush_s and not s.lock.locked()
        ]
        if due:
            await asyncio.gather(*(self._publish(rid, s) for rid, s in due))

    async def close(self, final: TokenChunk | None) -> None:
        """End a request's stream: `final` (if any) to the client, then its copy after the
        request's queued ones, retried until stored or `give_up_s` has passed (then the
        record and the client hear which tokens the copy lacks: `TokensNotStored`)."""
        s = self._streams.pop(final.request_id if final else "", None)
        if s is None or final is None:
            return
        if s.reply_to:
            await self._nc.publish(s.reply_to, final.to_json())
        async with s.lock:  # after a batch in flight: stored, or back in `pending`
            s.pending.append(final)
            chunks, s.pending = s.pending, []
            try:
                await self._final.publish_raw(
                    s.subject, TokenBatch(chunks=chunks, owner=s.owner).to_json(),
                    {MSG_ID: f"tok:{final.request_id}:done"},
                )  # fmt: skip
            except Exception as exc:
                await self._not_stored(final.request_id, s, chunks, exc)

    def discard(self, request_id: str) -> None:
        """Forget a request without a final chunk (another instance ended it)."""
        self._streams.pop(request_id, None)

    async def _publish(self, request_id: str, s: _Stream) -> None:
        """Store the queued copies as one batch, in one attempt. A batch that cannot be
        stored (the broker is failing over) goes back in front of the queue and is sent
        again, with what follows, at the next flush or with the final chunk. Readers skip
        indexes they already have, so a batch stored twice (an ack lost, not the message)
        is harmless."""
        async with s.lock:
            chunks, s.pending = s.pending, []
            if not chunks:
                return
            first, last = chunks[0].index, chunks[-1].index
            payload = TokenBatch(chunks=chunks, owner=s.owner).to_json()
            try:
                await self._js.publish(
                    s.subject, payload, headers={MSG_ID: batch_msg_id(request_id, first, last)},
                    timeout=5.0,
                )  # fmt: skip
            except Exception as exc:
                s.pending[:0] = chunks
                log.info("token copy of %s [%d..%d] deferred: %s", request_id, first, last, exc)

    async def _not_stored(
        self, request_id: str, s: _Stream, chunks: list[TokenChunk], exc: BaseException
    ) -> None:
        """The copy of `chunks` is given up: say so in the log, the record and to the client
        (each best effort: the broker is what failed)."""
        first, last = chunks[0].index, chunks[-1].index
        log.error("token copy of %s [%d..%d] not stored: %s", request_id, first, last, exc)
        metrics.TOKEN_COPIES_NOT_STORED.inc()
        fact = ev.TokensNotStored(
            event_id=ev.derived_event_id(f"tok:{request_id}", "not_stored"),
            request_id=request_id, instance=self._instance, first_index=first,
            last_index=last, detail=f"{type(exc).__name__}: {exc}"[:2000],
        )  # fmt: skip
        try:
            if s.reply_to:
                await self._nc.publish(s.reply_to, fact.to_json())
            await self._final.publish(fact)
        except Exception as again:
            log.error("%s: the missing token copy is not recorded either: %s", request_id, again)


# --- reading back -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Stored:
    """One batch of a request's copy as read, and how many messages of the request the
    stream held after it when it was delivered (0: the copy is read to its current end)."""

    batch: TokenBatch
    pending: int


# How long opening a read of the copy rides out a broker failing over: the stream's new leader
# is elected in seconds, and each try of the consumer's creation waits up to the JetStream
# API timeout (5 s).
OPEN_WITHIN_S = 20.0


async def stored_batches(
    js: JetStreamContext, ns: Namespace, request_id: str, *, idle_timeout_s: float,
    open_within_s: float = OPEN_WITHIN_S,
) -> AsyncGenerator[Stored, None]:  # fmt: skip
    """The request's copy, batch by batch as stored and then as it grows, until nothing has
    arrived for `idle_timeout_s`. Unreadable messages are skipped (and logged). Opening the
    read rides out a leader election of MC_TOKENS for `open_within_s`."""
    subject = WorkSubjects(ns).tokens(request_id)

    async def open_read() -> JetStreamContext.PushSubscription:
        # An ordered consumer: ephemeral, no acks, recreated by the client across a reconnect.
        return await js.subscribe(
            subject, stream=ns.stream("MC_TOKENS"), ordered_consumer=True,
            deliver_policy=DeliverPolicy.ALL,
        )  # fmt: skip

    sub = await retry_transient(open_read, open_within_s)
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=idle_timeout_s)
            except TimeoutError:
                return
            try:
                batch = TokenBatch.model_validate_json(msg.data)
            except ValidationError:
                log.warning("unreadable token batch on %s", subject)
                continue
            yield Stored(batch, msg.metadata.num_pending)
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


class InOrder:
    """Chunks of a request's copy from an offset on, in order and each index once (a
    redelivered decode stores some again), the final (`done`) chunk last."""

    def __init__(self, request_id: str, from_index: int) -> None:
        self.request_id, self.following, self.done = request_id, from_index, False

    def take(self, batch: TokenBatch) -> list[TokenChunk]:
        out: list[TokenChunk] = []
        for chunk in batch.chunks:
            if self.done or chunk.request_id != self.request_id:
                continue
            if chunk.done:
                self.done = True
            elif chunk.index < self.following:
                continue  # a copy from a redelivered decode, or before the offset
            else:
                self.following = chunk.index + max(len(chunk.token_ids), 1)
            out.append(chunk)
        return out


async def resume_tokens(
    js: JetStreamContext,
    ns: Namespace,
    request_id: str,
    from_index: int = 0,
    *,
    idle_timeout_s: float = 30.0,
) -> AsyncIterator[TokenChunk]:
    """The request's chunks from index `from_index` on, in order and each index once, as they
    are stored and then as they arrive, until the final (`done`) chunk, or until nothing has
    arrived for `idle_timeout_s` (the request is not running anywhere)."""
    order = InOrder(request_id, from_index)
    batches = stored_batches(js, ns, request_id, idle_timeout_s=idle_timeout_s)
    async with contextlib.aclosing(batches):
        async for stored in batches:
            for chunk in order.take(stored.batch):
                yield chunk
            if order.done:
                return

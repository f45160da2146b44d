"""The token read-back service: a request's stored tokens for a client that may not read the
MC_TOKENS stream itself (the HTTP gateway's NATS user may not: deploy/nats/auth.conf).

Core NATS drops what is published while a client reconnects (a broker restart, a failover),
so a client can miss tokens of its stream or its final chunk; the request's copy on
MC_TOKENS (`serving.streaming`) holds them. A client with JetStream access reads the copy
itself (`client.fill_from_copy`); one without asks here (`mc.readback.tokens`,
request/reply; `client.read_back` asks and fills its `Outcome`).

Who may read what: every batch of a copy carries `owner_digest(reply_to)` of its request, and
an ask names the request's `reply_to`; only an ask whose `reply_to` matches is answered, and
only to a reply subject beside that `reply_to` (under the same parent, e.g.
`_INBOX.gateway.`), so a user who could only read its own inboxes gets nothing of another
user's requests even if it learned their reply subjects. Refusals say why.

The service runs in the Conductor's process (one subscription in a queue group, so any
number of Conductors share the asks); at most `MAX_CONCURRENT` reads run at a time, more are
answered `busy` at once rather than queued behind them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from pydantic import ValidationError

from mooncake import metrics
from mooncake.aio import cancel_all
from mooncake.namespace import Namespace
from mooncake.serving.streaming import InOrder, stored_batches
from mooncake.work import ReadBackAnswer, ReadBackAsk, TokenBatch, WorkSubjects, owner_digest

log = logging.getLogger("mooncake.serving.readback")

QUEUE = "readback"
MAX_CONCURRENT = 8
# How long an ask waits for a copy that holds nothing yet (or whose stream is quiet) before
# it answers with what it has: a read-back is a look at what is stored, not a subscription.
IDLE_S = 0.5


def reply_parent(subject: str) -> str:
    """A subject without its last token (`_INBOX.gateway` for `_INBOX.gateway.<nuid>`)."""
    return subject.rpartition(".")[0]


def ask_refusal(ask: ReadBackAsk, asker_reply: str) -> str | None:
    """Why an ask is not answered before anything is read, or None."""
    parent = reply_parent(ask.reply_to)
    if not parent or not asker_reply.startswith(parent + "."):
        return (
            f"the answer must go to a subject under {parent or ask.reply_to!r}, where the "
            "request's replies went"
        )
    return None


def batch_refusal(ask: ReadBackAsk, batch: TokenBatch) -> str | None:
    """Why a batch of the copy is not the asker's to read, or None."""
    if batch.owner is None or batch.owner != owner_digest(ask.reply_to):
        return f"request {ask.request_id} was not submitted with this reply subject"
    return None


async def read(js: JetStreamContext, ns: Namespace, ask: ReadBackAsk, asker_reply: str,
               *, idle_s: float = IDLE_S) -> ReadBackAnswer:  # fmt: skip
    """What the copy holds for `ask` now, or the refusal."""
    if (why := ask_refusal(ask, asker_reply)) is not None:
        return ReadBackAnswer(error=why)
    order = InOrder(ask.request_id, ask.from_index)
    chunks = []
    batches = stored_batches(js, ns, ask.request_id, idle_timeout_s=idle_s)
    async with contextlib.aclosing(batches):
        async for stored in batches:
            if (why := batch_refusal(ask, stored.batch)) is not None:
                return ReadBackAnswer(error=why)
            chunks.extend(order.take(stored.batch))
            if len(chunks) > ask.max_chunks:
                return ReadBackAnswer(chunks=chunks[: ask.max_chunks], more=True)
            if order.done or stored.pending == 0:
                break
    return ReadBackAnswer(chunks=chunks)


class TokenReadBack:
    def __init__(
        self, nc: NATS, js: JetStreamContext, ns: Namespace, *, limit: int = MAX_CONCURRENT
    ) -> None:
        self.nc, self.js, self.ns, self.limit = nc, js, ns, limit
        self._sub: Subscription | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        subject = WorkSubjects(self.ns).read_back()
        self._sub = await self.nc.subscribe(subject, queue=QUEUE, cb=self._on_ask)

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None
        await cancel_all(list(self._tasks))

    async def _on_ask(self, msg: Msg) -> None:
        # Subscription callbacks run one at a time: the read runs beside them.
        if not msg.reply:
            return
        if len(self._tasks) >= self.limit:
            metrics.TOKEN_READ_BACKS.labels("busy").inc()
            busy = ReadBackAnswer(error=f"busy: {self.limit} read-backs running", retry=True)
            with contextlib.suppress(Exception):
                await self.nc.publish(msg.reply, busy.to_json())
            return
        task = asyncio.create_task(self._answer(msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, msg: Msg) -> None:
        try:
            ask = ReadBackAsk.model_validate_json(msg.data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first.get("loc", ())) or "body"
            answer = ReadBackAnswer(error=f"invalid ask: {where}: {first.get('msg', '')}"[:500])
        else:
            try:
                answer = await read(self.js, self.ns, ask, msg.reply)
            except Exception as exc:  # the copy cannot be read now (an outage): say so
                log.warning("read-back of %s failed: %s", ask.request_id, exc)
                why = f"unavailable: {type(exc).__name__}: {exc}"[:500]
                answer = ReadBackAnswer(error=why, retry=True)
        metrics.TOKEN_READ_BACKS.labels("refused" if answer.error else "answered").inc()
        with contextlib.suppress(Exception):  # the asker may be gone; it asks again
            await self.nc.publish(msg.reply, answer.to_json())

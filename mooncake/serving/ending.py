"""How a request ends, whoever ends it: claim → terminal event → final chunk → reply.

Every end goes through the terminal claim (`mooncake.bus.terminal`): whoever claims the
request's slot first publishes its one terminal event (completed, failed, cancelled or
rejected);
everybody else (a decode worker that finishes a moment after a cancel, a second cancel, a
stage that fails a request another instance completed) loses the claim and publishes nothing.
The claim value is the event id, so a redelivered handler that claimed and crashed before
publishing claims again and publishes the same (deduplicated) event.

The client hears it too: a final `TokenChunk(done, finish_reason)`. Stages that stream tokens
send it through their token streamer (which also keeps the replayable copy); the others
publish it on the request's `reply_to` (`reply`). A rejection's client hears the rejection
event itself. HTTP clients are among them: the gateway is the submitter, and answers its
client from what comes back on the reply subject.

A rejection is claimed like every end, so a cancel that got there first wins and the
rejection is not published. The Conductor claims a batch's rejections together before it
publishes the batch (`claim_rejections`); `reject` is one rejection from start to end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Literal

from nats.aio.client import Client as NATS
from nats.js.kv import KeyValue

from mooncake import events as ev
from mooncake import metrics
from mooncake.bus import terminal
from mooncake.bus.publish import Publisher
from mooncake.work import TokenChunk

log = logging.getLogger("mooncake.ending")

Terminal = ev.RequestCompleted | ev.RequestFailed | ev.RequestCancelled
SendFinal = Callable[[TokenChunk], Awaitable[None]]
FailStage = Literal["admission", "prefill", "decode", "store", "unknown"]
CancelStage = Literal["admission", "prefill", "decode", "unknown"]

_KIND: dict[type[ev.Event], str] = {
    ev.RequestCompleted: "completed",
    ev.RequestFailed: "failed",
    ev.RequestCancelled: "cancelled",
}


class Ender:
    def __init__(self, nc: NATS, publisher: Publisher, kv: KeyValue) -> None:
        self.nc, self.publisher, self.kv = nc, publisher, kv

    async def end(
        self,
        event: Terminal,
        final: TokenChunk | None,
        *,
        reply_to: str | None = None,
        send: SendFinal | None = None,
    ) -> bool:
        """End the request with `event` unless something else ended it first; True if this
        did. `final` goes through `send` when given, else to `reply_to` (if any)."""
        kind = _KIND[type(event)]
        if not await terminal.claim(self.kv, event.request_id, kind, event.event_id):
            return False
        await self.publisher.publish(event)
        if final is not None:
            if send is not None:
                await send(final)
            else:
                await reply(self.nc, reply_to, final.to_json())
        return True

    async def reject(self, event: ev.RequestRejected, *, reply_to: str | None) -> bool:
        """End the request with its rejection unless it ended first; True if this did."""
        if not await self.claim_rejection(event):
            return False
        await self.publisher.publish(event)
        await reply(self.nc, reply_to, event.to_json())
        return True

    async def claim_rejections(
        self, events: Sequence[ev.RequestRejected]
    ) -> list[bool | BaseException]:
        """The terminal slots of `events`' requests, claimed together (before the caller
        publishes them): True where the rejection ends its request, False where something
        ended it first (a cancel), the error where the claim could not be made."""
        claims = (self.claim_rejection(e) for e in events)
        return list(await asyncio.gather(*claims, return_exceptions=True))

    async def claim_rejection(self, event: ev.RequestRejected) -> bool:
        """The request's terminal slot for `event`: False where something ended it first."""
        return await terminal.claim(self.kv, event.request_id, "rejected", event.event_id)

    async def fail(
        self,
        request_id: str,
        event_id: str,
        *,
        reason: str,
        stage: FailStage,
        detail: str = "",
        reply_to: str | None = None,
        index: int = 0,
        send: SendFinal | None = None,
    ) -> bool:
        event = ev.RequestFailed(
            event_id=event_id, request_id=request_id, reason=reason, stage=stage,
            detail=detail[:2000],
        )  # fmt: skip
        error = f"{reason}: {detail}"[:2000] if detail else reason
        ended = await self.end(event, final(request_id, index, "failed", error),
                               reply_to=reply_to, send=send)  # fmt: skip
        if ended:  # the role's log says why, not only the record
            log.warning("request %s failed at %s: %s", request_id, stage, error)
        return ended

    async def cancel(
        self,
        request_id: str,
        event_id: str,
        *,
        reason: str,
        stage: CancelStage,
        reply_to: str | None = None,
        index: int = 0,
        send: SendFinal | None = None,
    ) -> bool:
        event = ev.RequestCancelled(
            event_id=event_id, request_id=request_id, reason=reason, stage=stage
        )
        return await self.end(event, final(request_id, index, "cancelled"),
                              reply_to=reply_to, send=send)  # fmt: skip

    async def ended(self, request_id: str) -> str | None:
        return await terminal.ended(self.kv, request_id)


async def reply(nc: NATS, reply_to: str | None, payload: bytes) -> None:
    """To the submitter's reply subject, if it gave one (core NATS: best effort, the record
    holds every decision and end)."""
    if reply_to:
        with contextlib.suppress(Exception):
            await nc.publish(reply_to, payload)


def final(
    request_id: str,
    index: int,
    finish: Literal["stop", "length", "cancelled", "failed"],
    error: str | None = None,
    text: str = "",
) -> TokenChunk:
    """The client's last chunk: `index` is the number of tokens it was sent (no offset for
    an end that carries no tokens)."""
    return TokenChunk(
        request_id=request_id, index=index, text=text, done=True, finish_reason=finish,
        error=error,
    )  # fmt: skip


def observe_completed(stage: str, finish_reason: str, ttft_s: float, tbt_s: float | None) -> None:
    """A request `stage` completed (it won the terminal claim: counted once)."""
    metrics.REQUESTS_ENDED.labels("completed", stage, finish_reason).inc()
    metrics.TTFT_SECONDS.observe(ttft_s)
    if tbt_s is not None:  # a single decoded token has no gap to score
        metrics.TBT_SECONDS.observe(tbt_s)

"""Ingress: what to do with one message from `mc.req.submitted`. Pure.

- a valid submission goes on to admission;
- an invalid one whose request id can be read becomes a `request.rejected` with reason
  `invalid_request`, told to its `reply_to` too where that can be read (so the client hears
  back); so does one whose `reply_to` is one of the system's own subjects (the workers would
  publish tokens and decisions there for it), told to nobody;
- anything else is dead-lettered (there is nobody to answer).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from mooncake import events as ev


@dataclass(frozen=True, slots=True)
class Accept:
    request: ev.RequestSubmitted


@dataclass(frozen=True, slots=True)
class Reject:
    event: ev.RequestRejected
    reply_to: str | None = None  # the submitter's, to tell it (never one of the system's)


@dataclass(frozen=True, slots=True)
class Discard:
    reason: str
    detail: str


IngressDecision = Accept | Reject | Discard


def reserved_reply_prefixes(namespace_prefix: str) -> tuple[str, ...]:
    """Subjects a submission may not name as its `reply_to`: the namespace's own and the
    server's (JetStream API, KV and object buckets, system account)."""
    return (f"{namespace_prefix}.", "$JS.", "$KV.", "$O.", "$SYS.")


def judge(
    parsed: ev.Event | ev.InvalidEvent,
    *,
    msg_id: str | None,
    now: datetime,
    reserved: tuple[str, ...] = (),
) -> IngressDecision:
    if isinstance(parsed, ev.RequestSubmitted):
        if parsed.reply_to is None or not parsed.reply_to.startswith(reserved):
            return Accept(parsed)
        detail = f"reply_to {parsed.reply_to!r} is a subject of the system; use an inbox"
        return _reject("invalid_request", detail, parsed.request_id, msg_id, now)
    request_id: str | None
    reply_to: str | None = None
    if isinstance(parsed, ev.InvalidEvent):
        reason, detail, request_id = parsed.reason, parsed.detail, parsed.request_id
        if parsed.reply_to is not None and not parsed.reply_to.startswith(reserved):
            reply_to = parsed.reply_to
    else:  # a valid event of another type on the public subject (parse_event refuses it)
        reason, detail, request_id = "invalid_request", f"unexpected {parsed.type}", None
    if request_id is None:
        return Discard(reason, detail)
    return _reject(reason, detail, request_id, msg_id, now, reply_to)


def _reject(
    reason: str,
    detail: str,
    request_id: str,
    msg_id: str | None,
    now: datetime,
    reply_to: str | None = None,
) -> Reject:
    event_id = ev.derived_event_id(msg_id or f"req:{request_id}", "rejected")
    return Reject(
        ev.RequestRejected(
            event_id=event_id,
            request_id=request_id,
            occurred_at=now,
            reason=ev.RejectReason.INVALID_REQUEST,
            stage="ingress",
            # The reason is invalid_request; a narrower cause (payload_too_large) leads the detail.
            detail=(detail if reason == "invalid_request" else f"{reason}: {detail}")[:2000],
        ),
        reply_to,
    )


def fit_context(
    prompt_tokens: int, max_tokens: int, context: int, *, max_tokens_given: bool
) -> int | tuple[ev.RejectReason, str]:
    """The most tokens a request may generate within the model's context, or why it cannot run.

    A prompt that fills the context leaves no room for output: `prompt_too_long`. A
    `max_tokens` the client asked for that would run past the context is `max_tokens_too_large`
    (as OpenAI's API does), with the most it may ask for; a default `max_tokens` the client did
    not ask for is cut to the room left instead."""
    if prompt_tokens >= context:
        return (
            ev.RejectReason.PROMPT_TOO_LONG,
            f"the prompt has {prompt_tokens:,} tokens and the model's context is {context:,}, "
            f"which leaves no room for output: a prompt may have at most {context - 1:,} tokens",
        )
    room = context - prompt_tokens
    if max_tokens <= room:
        return max_tokens
    if not max_tokens_given:
        return room
    return (
        ev.RejectReason.MAX_TOKENS_TOO_LARGE,
        f"max_tokens {max_tokens:,} and the prompt's {prompt_tokens:,} tokens come to "
        f"{prompt_tokens + max_tokens:,}, past the model's context of {context:,}: ask for at "
        f"most {room:,} tokens",
    )

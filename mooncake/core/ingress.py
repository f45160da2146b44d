"""Ingress: what to do with one message from `mc.req.submitted`. Pure.

- a valid submission goes on to admission;
- an invalid one whose request id can be read becomes a `request.rejected` with reason
  `invalid_request` (so the client hears back); so does one whose `reply_to` is one of the
  system's own subjects (the workers would publish tokens and decisions there for it);
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
        reply_to = parsed.reply_to
        if reply_to is None or not reply_to.startswith(reserved):
            return Accept(parsed)
        detail = f"reply_to {reply_to!r} is a subject of the system; use an inbox"
        return _reject("invalid_request", detail, parsed.request_id, msg_id, now)
    request_id: str | None
    if isinstance(parsed, ev.InvalidEvent):
        reason, detail, request_id = parsed.reason, parsed.detail, parsed.request_id
    else:  # a valid event of another type on the public subject (parse_event refuses it)
        reason, detail, request_id = "invalid_request", f"unexpected {parsed.type}", None
    if request_id is None:
        return Discard(reason, detail)
    return _reject(reason, detail, request_id, msg_id, now)


def _reject(reason: str, detail: str, request_id: str, msg_id: str | None, now: datetime) -> Reject:
    event_id = ev.derived_event_id(msg_id or f"req:{request_id}", "rejected")
    return Reject(
        ev.RequestRejected(
            event_id=event_id,
            request_id=request_id,
            occurred_at=now,
            reason=ev.RejectReason.INVALID_REQUEST,
            stage="ingress",
            detail=f"{reason}: {detail}"[:2000],
        )
    )

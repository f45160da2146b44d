"""Ingress: what to do with one message from `mc.req.submitted`. Pure.

- a valid submission goes on to admission;
- an invalid one whose request id can be read becomes a `request.rejected` with reason
  `invalid_request` (so the client hears back);
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


def judge(
    parsed: ev.Event | ev.InvalidEvent, *, msg_id: str | None, now: datetime
) -> IngressDecision:
    if isinstance(parsed, ev.RequestSubmitted):
        return Accept(parsed)
    if isinstance(parsed, ev.InvalidEvent):
        reason, detail, request_id = parsed.reason, parsed.detail, parsed.request_id
    else:  # a valid event of another type on the public subject (parse_event refuses it)
        reason, detail, request_id = "invalid_request", f"unexpected {parsed.type}", None
    if request_id is None:
        return Discard(reason, detail)
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

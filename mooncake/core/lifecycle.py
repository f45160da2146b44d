"""The request state machine: `apply(state, event) -> Transition`. Pure: no I/O, no clocks.

Illegal transitions are reported in `Transition.error` and the state is returned
unchanged, so a consumer can record and count them without ever corrupting a projection.
Terminal states are a named set (`TERMINAL`), never an ordering trick.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime
from enum import StrEnum

from mooncake import events as ev


class Status(StrEnum):
    SUBMITTED = "submitted"
    ADMITTED = "admitted"
    PREFILLING = "prefilling"
    PREFILLED = "prefilled"
    DECODING = "decoding"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    REJECTED = "rejected"


TERMINAL: frozenset[Status] = frozenset(
    {Status.COMPLETED, Status.FAILED, Status.CANCELLED, Status.REJECTED}
)
# Where each (non-terminal-producing) event may be applied from; None = no state yet.
_ALLOWED_FROM: dict[type[ev.RequestEvent], frozenset[Status | None]] = {
    ev.RequestSubmitted: frozenset({None}),
    ev.RequestAdmitted: frozenset({Status.SUBMITTED}),
    # Rejection at ingress (never validly submitted), at admission, or - under the
    # baseline policy - by a later stage that finds itself overloaded.
    ev.RequestRejected: frozenset(
        {None, Status.SUBMITTED, Status.ADMITTED, Status.PREFILLING, Status.PREFILLED}
    ),
    # A redelivered prefill (worker died) starts again on another instance.
    ev.PrefillStarted: frozenset({Status.ADMITTED, Status.PREFILLING}),
    ev.RequestPrefilled: frozenset({Status.ADMITTED, Status.PREFILLING}),
    ev.DecodeStarted: frozenset({Status.PREFILLED, Status.DECODING}),
    # Preempted for KV pages and resumed on the same instance: still decoding throughout.
    ev.DecodePreempted: frozenset({Status.DECODING}),
    ev.DecodeResumed: frozenset({Status.DECODING}),
    ev.RequestCompleted: frozenset({Status.PREFILLED, Status.DECODING}),
    # How many tokens a cancelled request's client got: from the decode instance that
    # stopped it, recorded before or after the cancellation (different publishers).
    ev.DecodeStopped: frozenset({Status.DECODING, Status.CANCELLED}),
}
# Facts about a request that may follow its terminal event (they annotate, never change it).
_AFTER_TERMINAL: tuple[type[ev.RequestEvent], ...] = (ev.DecodeStopped, ev.TokensNotStored)


@dataclass(frozen=True, slots=True)
class RequestState:
    request_id: str
    status: Status
    submitted_at: datetime | None = None
    updated_at: datetime | None = None
    finished_at: datetime | None = None
    slo_class: str | None = None
    client_id: str | None = None
    tenant: str | None = None
    max_tokens: int | None = None
    policy: str | None = None
    prefill_instance: str | None = None
    decode_instance: str | None = None
    prompt_tokens: int | None = None
    cached_tokens: int = 0
    remote_cached_tokens: int = 0
    output_tokens: int = 0
    prefill_attempts: int = 0
    decode_attempts: int = 0
    preemptions: int = 0  # times a decode instance preempted it for KV pages
    predicted_ttft_s: float | None = None
    predicted_tbt_s: float | None = None
    prefill_s: float | None = None
    ttft_s: float | None = None
    tbt_s: float | None = None
    finish_reason: str | None = None
    reject_reason: str | None = None
    failure_reason: str | None = None
    cancel_requested: bool = False
    last_event_id: str | None = None

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL


@dataclass(frozen=True, slots=True)
class Transition:
    state: RequestState | None
    error: str | None = None

    @property
    def applied(self) -> bool:
        return self.error is None


def apply(state: RequestState | None, event: ev.RequestEvent) -> Transition:
    """Fold one request event into the request's state."""
    if state is not None and state.request_id != event.request_id:
        return Transition(state, f"event for {event.request_id} applied to {state.request_id}")
    current = state.status if state is not None else None
    if current in TERMINAL and not isinstance(event, _AFTER_TERMINAL):
        return Transition(state, f"{event.type} after terminal state {current}")
    allowed = _ALLOWED_FROM.get(type(event))
    if allowed is not None and current not in allowed:
        return Transition(state, f"{event.type} not allowed from {current or 'no state'}")
    if state is None and not isinstance(event, ev.RequestSubmitted | ev.RequestRejected):
        return Transition(None, f"{event.type} for unknown request {event.request_id}")
    base = state or RequestState(request_id=event.request_id, status=Status.SUBMITTED)
    new = _fold(base, event)
    return Transition(replace(new, updated_at=event.occurred_at, last_event_id=event.event_id))


def _fold(s: RequestState, e: ev.RequestEvent) -> RequestState:
    match e:
        case ev.RequestSubmitted():
            return replace(
                s,
                status=Status.SUBMITTED,
                submitted_at=e.occurred_at,
                slo_class=e.slo_class,
                client_id=e.client_id,
                tenant=e.tenant,
                max_tokens=e.params.max_tokens,
                prompt_tokens=len(e.token_ids) if e.token_ids is not None else None,
            )
        case ev.RequestAdmitted():
            return replace(
                s,
                status=Status.ADMITTED,
                policy=e.policy,
                prefill_instance=e.prefill_instance,
                decode_instance=e.decode_instance,
                prompt_tokens=e.prompt_tokens if e.prompt_tokens is not None else s.prompt_tokens,
                predicted_ttft_s=e.predicted_ttft_s,
                predicted_tbt_s=e.predicted_tbt_s,
            )
        case ev.RequestRejected():
            return _finish(
                s, e, Status.REJECTED, reject_reason=e.reason.value, policy=e.policy or s.policy
            )
        case ev.PrefillStarted():
            return replace(
                s,
                status=Status.PREFILLING,
                prefill_instance=e.instance,
                prefill_attempts=s.prefill_attempts + 1,
            )
        case ev.RequestPrefilled():
            return replace(
                s,
                status=Status.PREFILLED,
                prefill_instance=e.instance,
                prompt_tokens=e.prompt_tokens,
                cached_tokens=e.cached_tokens,
                remote_cached_tokens=e.remote_cached_tokens,
                prefill_s=e.prefill_s,
            )
        case ev.DecodeStarted():
            return replace(
                s,
                status=Status.DECODING,
                decode_instance=e.instance,
                decode_attempts=s.decode_attempts + 1,
            )
        case ev.DecodePreempted():
            return replace(s, preemptions=s.preemptions + 1)
        case ev.DecodeStopped():
            return replace(s, output_tokens=e.output_tokens)
        case ev.RequestCompleted():
            return _finish(
                s,
                e,
                Status.COMPLETED,
                output_tokens=e.output_tokens,
                finish_reason=e.finish_reason,
                ttft_s=e.ttft_s,
                tbt_s=e.tbt_s,
            )
        case ev.RequestFailed():
            return _finish(s, e, Status.FAILED, failure_reason=e.reason)
        case ev.CancelRequested():
            return replace(s, cancel_requested=True)
        case ev.RequestCancelled():
            return _finish(s, e, Status.CANCELLED, cancel_requested=True)
    return s  # an event type that does not change request state


def _finish(s: RequestState, e: ev.RequestEvent, status: Status, **changes: object) -> RequestState:
    return replace(s, status=status, finished_at=e.occurred_at, **changes)  # type: ignore[arg-type]


def fold(events: list[ev.RequestEvent]) -> tuple[RequestState | None, list[str]]:
    """Fold a request's events in order; returns the state and the illegal transitions seen."""
    state: RequestState | None = None
    errors: list[str] = []
    for e in events:
        t = apply(state, e)
        state = t.state
        if t.error:
            errors.append(t.error)
    return state, errors

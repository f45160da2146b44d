"""The request state machine."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from mooncake import events as ev
from mooncake.core.lifecycle import TERMINAL, RequestState, Status, apply, fold

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def at(s: float) -> datetime:
    return T0 + timedelta(seconds=s)


def happy_path(rid: str = "r") -> list[ev.RequestEvent]:
    return [
        ev.RequestSubmitted(request_id=rid, token_ids=[1, 2, 3], occurred_at=at(0)),
        ev.RequestAdmitted(
            request_id=rid, policy="none", prefill_instance="p0", decode_instance="d0",
            occurred_at=at(0.01),
        ),
        ev.PrefillStarted(request_id=rid, instance="p0", occurred_at=at(0.02)),
        ev.RequestPrefilled(
            request_id=rid, instance="p0", prompt_tokens=3, cached_tokens=0, prefill_s=0.1,
            occurred_at=at(0.2),
        ),
        ev.DecodeStarted(request_id=rid, instance="d0", occurred_at=at(0.21)),
        ev.RequestCompleted(
            request_id=rid, output_tokens=5, ttft_s=0.25, tbt_s=0.03, occurred_at=at(0.5)
        ),
    ]  # fmt: skip


def test_happy_path_ends_completed_with_the_facts_folded_in() -> None:
    state, errors = fold(happy_path())
    assert errors == []
    assert state is not None
    assert state.status is Status.COMPLETED
    assert state.terminal
    assert (state.prompt_tokens, state.output_tokens) == (3, 5)
    assert (state.prefill_instance, state.decode_instance) == ("p0", "d0")
    assert state.submitted_at == at(0) and state.finished_at == at(0.5)
    assert state.ttft_s == 0.25 and state.tbt_s == 0.03
    assert state.prefill_attempts == 1 and state.decode_attempts == 1


def test_terminal_states_are_a_named_set() -> None:
    assert {Status.COMPLETED, Status.FAILED, Status.CANCELLED, Status.REJECTED} == TERMINAL


def test_illegal_transitions_are_reported_and_not_applied() -> None:
    submitted, admitted = happy_path()[:2]
    state = apply(None, submitted).state
    t = apply(state, ev.RequestCompleted(request_id="r", output_tokens=1))
    assert t.error is not None and "not allowed" in t.error
    assert t.state is state  # unchanged
    assert apply(None, admitted).error  # unknown request
    assert apply(state, submitted).error  # a second submission


def test_nothing_leaves_a_terminal_state() -> None:
    events = happy_path()
    done, _ = fold(events)
    late = [ev.RequestCancelled(request_id="r"), ev.RequestFailed(request_id="r", reason="x")]
    for e in [*events, *late]:
        t = apply(done, e)
        assert t.error is not None and t.state is done


def test_ingress_rejection_without_submission_and_cancel_anywhere() -> None:
    rej = ev.RequestRejected(request_id="x", reason=ev.RejectReason.INVALID_REQUEST)
    state = apply(None, rej).state
    assert state is not None and state.status is Status.REJECTED
    submitted, admitted = happy_path("c")[:2]
    s, _ = fold([submitted, admitted, ev.CancelRequested(request_id="c")])
    assert s is not None and s.cancel_requested and s.status is Status.ADMITTED
    s2 = apply(s, ev.RequestCancelled(request_id="c", stage="admission")).state
    assert s2 is not None and s2.status is Status.CANCELLED


def test_redelivered_work_counts_attempts() -> None:
    e = happy_path()
    s, errors = fold([*e[:3], ev.PrefillStarted(request_id="r", instance="p1"), *e[3:]])
    assert errors == [] and s is not None
    assert s.prefill_attempts == 2 and s.prefill_instance == "p0"


def _event_pool(rid: str) -> list[ev.RequestEvent]:
    return [
        *happy_path(rid),
        ev.RequestRejected(request_id=rid, reason=ev.RejectReason.TBT_SLO),
        ev.RequestFailed(request_id=rid, reason="boom"),
        ev.CancelRequested(request_id=rid),
        ev.RequestCancelled(request_id=rid),
    ]


@given(st.lists(st.integers(min_value=0, max_value=9), max_size=25))
def test_any_sequence_never_leaves_a_terminal_state_and_errors_keep_state(idx: list[int]) -> None:
    pool = _event_pool("p")
    state: RequestState | None = None
    was_terminal = False
    for i in idx:
        t = apply(state, pool[i])
        if t.error:
            assert t.state is state
        state = t.state
        if was_terminal:
            assert state is not None and state.terminal
        was_terminal = state is not None and state.terminal


def test_preemptions_are_counted_while_the_request_stays_decoding() -> None:
    events = happy_path()
    completed = events.pop()
    for n in (1, 2):
        events += [
            ev.DecodePreempted(request_id="r", instance="d0", preemption=n, occurred_at=at(n)),
            ev.DecodeResumed(request_id="r", instance="d0", preemption=n, occurred_at=at(n + 0.5)),
        ]
    state, errors = fold(events)
    assert errors == [] and state is not None
    assert state.status is Status.DECODING and state.preemptions == 2
    state, errors = fold([*events, completed.model_copy(update={"occurred_at": at(3)})])
    assert errors == [] and state is not None and state.status is Status.COMPLETED


def test_a_preemption_before_decoding_is_illegal() -> None:
    state, _ = fold(happy_path()[:4])  # prefilled, decode not started
    t = apply(state, ev.DecodePreempted(request_id="r", instance="d0"))
    assert t.error is not None and state is not None and t.state == state


def test_a_cancelled_requests_output_tokens_come_from_the_decode_that_stopped_it() -> None:
    """The Conductor publishes the cancellation without knowing how many tokens went out;
    the decode's `DecodeStopped` says, recorded before or after it."""
    decoding = happy_path()[:-1]
    cancelled = ev.RequestCancelled(request_id="r", stage="decode", occurred_at=at(1))
    stopped = ev.DecodeStopped(
        request_id="r", instance="d0", reason="ended:cancelled", output_tokens=7,
        occurred_at=at(1.01),
    )  # fmt: skip
    for order in ([cancelled, stopped], [stopped, cancelled]):
        state, errors = fold([*decoding, *order])
        assert errors == [] and state is not None
        assert (state.status, state.output_tokens) == (Status.CANCELLED, 7)
    # It annotates a cancellation only: after a completion or before decoding it is illegal.
    done, _ = fold(happy_path())
    assert apply(done, stopped).error is not None
    prefilled, _ = fold(happy_path()[:4])
    assert apply(prefilled, stopped).error is not None


def test_a_token_copy_given_up_annotates_a_completed_request() -> None:
    """`TokensNotStored` follows the terminal event (the final batch is the last thing a
    decode stores) and changes nothing of the request's state but its last event."""
    done, _ = fold(happy_path())
    assert done is not None
    fact = ev.TokensNotStored(
        request_id="r", instance="d0", first_index=3, last_index=5, occurred_at=at(9)
    )
    t = apply(done, fact)
    assert t.error is None and t.state is not None
    assert t.state.status is Status.COMPLETED
    assert t.state.output_tokens == done.output_tokens
    assert t.state.last_event_id == fact.event_id

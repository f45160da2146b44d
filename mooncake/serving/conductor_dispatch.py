"""Pure pieces of the Conductor's dispatch: a Decision -> the events and the work it sends.

Ids are derived from the submission (`derived_event_id` of `submission_key`), so a
redelivered submission produces the same events and the same `PrefillWork` message id, and
the broker's dedupe window and the recorder's unique index drop the copies. The key is the
request id *and* the client's event id: the event id alone is the client's to choose, and two
requests that reuse one (a careless or hostile client) would otherwise get one decision id,
and the broker would drop the second request's decision as a duplicate of the first.

A submission has one decision id, whether it is admitted or rejected: a submission decided
twice (its decision reached the broker but the ack did not reach us, or it was redelivered
while still being handled) can get a different decision the second time (the cluster moved
on; a redelivery is not counted against its client's limit), and the broker's dedupe then
drops the second one. The Conductor acts on the decision the broker kept
(`Conductor._adopt_stored`, with `same_decision` and `prefill_work_of_admission`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mooncake import events as ev
from mooncake.core.conductor import Decision, rejection_detail
from mooncake.core.cpp import (
    DEFAULT_CHUNK_TOKENS,
    MAX_CHUNK_FACTOR,
    PrefillCost,
    capped,
    chunk_ranges,
)
from mooncake.events import RejectReason
from mooncake.hashing import cache_namespace
from mooncake.work import CppStage, PrefillWork, Timing


def submission_key(request: ev.RequestSubmitted) -> str:
    """What the ids derived from a submission are derived from (see the module's doc)."""
    return f"{request.request_id}/{request.event_id}"


def decision_event_id(request: ev.RequestSubmitted) -> str:
    """The id of the submission's decision: its `admitted` or its `rejected` event."""
    return ev.derived_event_id(submission_key(request), "decision")


def prefill_work_msg_id(request: ev.RequestSubmitted) -> str:
    """`Nats-Msg-Id` of a request's first PrefillWork."""
    return ev.derived_event_id(submission_key(request), "prefill-work-1")


def redispatch_msg_id(old_msg_id: str, attempt: int) -> str:
    """`Nats-Msg-Id` of work dispatched again (attempt >= 2) after its instance died.

    Derived from the message it replaces, not from the request: a request can reach decode
    through several prefill attempts, each sending its own DecodeWork (attempt 1, id from
    the prefill attempt), so "request + attempt" would collide and the broker would drop a
    live re-dispatch as a duplicate. A redelivered old message yields the same id again."""
    return ev.derived_event_id(old_msg_id, f"redispatch-{attempt}")


def timing_of(request: ev.RequestSubmitted) -> Timing:
    submitted = request.occurred_at.timestamp()
    deadline = submitted + request.deadline_s if request.deadline_s is not None else None
    return Timing(submitted_at=submitted, deadline_at=deadline)


def admitted_event(
    request: ev.RequestSubmitted, decision: Decision, inputs: dict[str, Any]
) -> ev.RequestAdmitted:
    return ev.RequestAdmitted(
        event_id=decision_event_id(request),
        request_id=request.request_id,
        policy=decision.policy,
        prefill_instance=decision.prefill_instance,
        decode_instance=decision.decode_instance,
        prompt_tokens=decision.prompt_tokens,
        cached_prefix_tokens=decision.prefix_tokens,
        predicted_ttft_s=decision.predicted_ttft_s,
        predicted_tbt_s=decision.predicted_tbt_s,
        inputs=inputs,
    )


def rejected_event(
    request: ev.RequestSubmitted,
    decision: Decision,
    inputs: dict[str, Any],
    detail: str | None = None,
) -> ev.RequestRejected:
    """A policy's rejection, with why (`detail`, else the decision's numbers in words)."""
    assert decision.reason is not None
    stage = decision.stage if decision.stage in ("admission", "prefill", "decode") else "admission"
    return ev.RequestRejected(
        event_id=decision_event_id(request),
        request_id=request.request_id,
        reason=decision.reason,
        stage=stage,
        detail=(detail or rejection_detail(decision))[:2000],
        policy=decision.policy,
        predicted_ttft_s=decision.predicted_ttft_s,
        predicted_tbt_s=decision.predicted_tbt_s,
        inputs=inputs,
    )


def invalid_event(
    request: ev.RequestSubmitted, detail: str, reason: RejectReason = RejectReason.INVALID_REQUEST
) -> ev.RequestRejected:
    """A rejection of the request itself (the client must change it), with why."""
    return ev.RequestRejected(
        event_id=decision_event_id(request),
        request_id=request.request_id,
        reason=reason,
        stage="admission",
        detail=detail[:2000],
    )


def namespace_of(request: ev.RequestSubmitted, shared_cache: Mapping[str, str]) -> str:
    """The cache namespace of a request (`hashing.cache_namespace`): the shared one it names,
    else the one configured for its tenant (`Settings.shared_cache`), else its tenant's own."""
    shared = request.cache_namespace or shared_cache.get(request.tenant)
    return cache_namespace(request.tenant, shared)


def stage_work_msg_id(request: ev.RequestSubmitted, stage: int) -> str:
    """`Nats-Msg-Id` of the first PrefillWork of a CPP group's stage `stage` (>= 1)."""
    return ev.derived_event_id(submission_key(request), f"prefill-work-1-stage-{stage}")


def prefill_work(
    request: ev.RequestSubmitted,
    decision: Decision,
    token_ids: list[int],
    admitted_event_id: str,
    block_tokens: int,
    namespace: str,
    cost: PrefillCost | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> PrefillWork:
    """The leader's work; where the decision chose a CPP group, it carries the group and the
    chunks: the new tokens cut as `choose_group` priced them (`core.cpp.chunk_ranges` with
    the cost model's `cost`, none longer than `MAX_CHUNK_FACTOR` x `chunk_tokens`), from
    the first position after the cached whole blocks."""
    assert decision.prefill_instance is not None and decision.decode_instance is not None
    cached = decision.prefix_tokens // block_tokens
    cpp = None
    if decision.stage_instances and cached * block_tokens < len(token_ids):
        chunks = capped(
            chunk_ranges(cached * block_tokens, len(token_ids), chunk_tokens, cost),
            MAX_CHUNK_FACTOR * chunk_tokens,
        )
        group = [decision.prefill_instance, *decision.stage_instances]
        cpp = CppStage(group=group, stage=0, chunks=chunks)
    return PrefillWork(
        cpp=cpp,
        request_id=request.request_id,
        attempt=1,
        token_ids=token_ids,
        params=request.params,
        reply_to=request.reply_to,
        prefill_instance=decision.prefill_instance,
        decode_instance=decision.decode_instance,
        timing=timing_of(request),
        cached_blocks=cached,
        local_blocks=min(decision.local_prefix_blocks, cached),
        load_limit_blocks=decision.load_limit_blocks,
        admitted_event_id=admitted_event_id,
        cache_namespace=namespace,
        tenant=request.tenant,
    )


def stage_works(work: PrefillWork) -> list[PrefillWork]:
    """The work of every other stage of the leader's group (none for one instance): the
    same request, its own stage. Sent in the same decision as the leader's, so every
    instance's queue holds groups in the Conductor's order (gang order)."""
    if work.cpp is None:
        return []
    cpp = work.cpp
    return [
        work.model_copy(update={"cpp": cpp.model_copy(update={"stage": s})})
        for s in range(1, len(cpp.group))
    ]


def same_decision(
    a: ev.RequestAdmitted | ev.RequestRejected, b: ev.RequestAdmitted | ev.RequestRejected
) -> bool:
    """Whether two decisions of one submission lead to the same work (admitted to the same
    instances). Rejections compare unequal, so the one the broker kept is the one told."""
    return (
        isinstance(a, ev.RequestAdmitted)
        and isinstance(b, ev.RequestAdmitted)
        and (a.prefill_instance, a.decode_instance) == (b.prefill_instance, b.decode_instance)
    )


def prefill_work_of_admission(
    request: ev.RequestSubmitted,
    admitted: ev.RequestAdmitted,
    token_ids: list[int],
    block_tokens: int,
    namespace: str,
) -> PrefillWork:
    """The work of an admission read back from the broker (see the module's doc): what
    `prefill_work` built from the decision, from the fields the event keeps."""
    local = admitted.inputs.get("local_prefix_blocks", 0)
    limit = admitted.inputs.get("load_limit_blocks")
    decision = Decision(
        request_id=request.request_id,
        policy=admitted.policy,
        admitted=True,
        reason=None,
        now=0.0,
        prompt_tokens=admitted.prompt_tokens or len(token_ids),
        prefill_instance=admitted.prefill_instance,
        decode_instance=admitted.decode_instance,
        local_prefix_blocks=local if isinstance(local, int) else 0,
        prefix_tokens=admitted.cached_prefix_tokens,
        load_limit_blocks=limit if isinstance(limit, int) and limit >= 0 else None,
    )
    return prefill_work(request, decision, token_ids, admitted.event_id, block_tokens, namespace)


def no_instance_delay(num_delivered: int, wait_s: float, max_deliver: int) -> float | None:
    """Delay before the next look at a submission that found no instance, or None: reject it.

    The waits grow geometrically (quick first retry, for a start-up race) and add up to
    `wait_s` over the deliveries the consumer allows (`max_deliver`; one more and the message
    would be dead-lettered instead of rejected)."""
    tries = max_deliver - 1
    if wait_s <= 0 or tries < 1 or num_delivered > tries:
        return None
    return float(wait_s * 2.0 ** (num_delivered - 1) / (2.0**tries - 1.0))

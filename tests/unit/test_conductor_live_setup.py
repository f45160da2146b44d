"""Settings -> the core's Conductor config and cost model; the dispatch's pure pieces."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pytest
from pydantic import ValidationError

from mooncake import events as ev
from mooncake.config import ConductorSettings, EngineSettings, Settings
from mooncake.core import conductor as cd
from mooncake.core.cost_model import AnalyticCostModel, FittedCostModel
from mooncake.serving import conductor_dispatch as dispatch
from mooncake.serving.conductor_setup import (
    build_costs,
    conductor_config,
    kv_bytes_per_token,
    online_model,
)


def test_settings_map_onto_the_core_config() -> None:
    s = Settings(
        block_tokens=64,
        slo={"ttft_s": 5.0, "tbt_s": 0.2},
        conductor=ConductorSettings(balancing_threshold=3.0, uniform_decode_s=4.0),
    )
    assert conductor_config(s) == cd.ConductorConfig(
        block_tokens=64,
        balancing_threshold=3.0,
        pool_fetch=True,
        ttft_slo_s=5.0,
        tbt_slo_s=0.2,
        uniform_decode_s=4.0,
    )


def test_policies_and_knobs_are_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOONCAKE_ADMISSION_POLICY", raising=False)  # conftest pins "none"
    assert Settings().admission_policy == "early"
    for p in ("none", "baseline", "early", "predicted"):
        assert Settings(admission_policy=p).admission_policy == p
    with pytest.raises(ValidationError):
        Settings(admission_policy="random")
    with pytest.raises(ValidationError):
        ConductorSettings(balancing_threshold=0.5)
    with pytest.raises(ValidationError):
        ConductorSettings(max_attempts=0)


def test_env_reaches_the_conductor_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOONCAKE_CONDUCTOR__MAX_ATTEMPTS", "7")
    monkeypatch.setenv("MOONCAKE_ADMISSION_POLICY", "predicted")
    s = Settings()
    assert (s.conductor.max_attempts, s.admission_policy) == (7, "predicted")


def test_costs_default_to_the_reference_hardware_corrected_online() -> None:
    costs = build_costs(Settings())
    online = online_model(costs)
    assert online is not None and costs.decode is online
    assert isinstance(online.seed_prefill, AnalyticCostModel)
    assert online.seed_prefill.hw.name == "8xA800"
    fixed = ConductorSettings(reference_hardware="8xH800", online_cost=False)
    h800 = build_costs(Settings(conductor=fixed))
    assert online_model(h800) is None
    assert isinstance(h800.prefill, AnalyticCostModel) and h800.prefill.hw.name == "8xH800"
    # The reference hardware's SSD read speed (an assumption), unless one was measured.
    assert costs.ssd is not None and costs.ssd.bandwidth_bytes_per_s == 24e9
    measured = build_costs(Settings(conductor=ConductorSettings(ssd_read_bytes_per_s=1.5e9)))
    assert measured.ssd is not None and measured.ssd.bandwidth_bytes_per_s == 1.5e9
    assert measured.ssd.bytes_per_token == costs.ssd.bytes_per_token


def test_costs_from_a_profile_fit_it(tmp_path: Path) -> None:
    doc = {
        "schema": "mooncake.profile/1",
        "prefill": [
            {"prompt_tokens": n, "cached_tokens": 0, "seconds": 0.01 * n} for n in (8, 32, 128)
        ],
        "decode": [
            {"batch": b, "context_tokens": c, "seconds": 0.002 * b}
            for b in (1, 4, 16)
            for c in (0, 500)
        ],
    }
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(doc))
    s = Settings(
        engine=EngineSettings(model="dummy"),
        conductor=ConductorSettings(cost_profile=path, transfer_bytes_per_s=2e9),
    )
    costs = build_costs(s)
    online = online_model(costs)
    assert online is not None and isinstance(online.seed_prefill, FittedCostModel)
    assert costs.prefill.prefill_s(100, 0) == pytest.approx(1.0, rel=1e-6)
    assert costs.decode.decode_step_s(10, 123) == pytest.approx(0.02, rel=1e-6)
    # The machine runs prefills twice as slow as profiled: the profile's rows anchor the
    # refit, the observations move it.
    for n in (16, 64, 256) * 20:
        online.observe_prefill(n, 0, 0.02 * n)
    assert costs.prefill.prefill_s(100, 0) == pytest.approx(2.0, rel=0.1)
    offline = Settings(
        engine=EngineSettings(model="dummy"),
        conductor=ConductorSettings(cost_profile=path, online_cost=False),
    )
    assert isinstance(build_costs(offline).prefill, FittedCostModel)
    assert costs.transfer.bandwidth_bytes_per_s == 2e9
    assert costs.transfer.bytes_per_token == kv_bytes_per_token(s.engine)
    # SSD reads: one NVMe drive's until measured; the online model keeps the seed's.
    assert costs.ssd is not None and costs.ssd.bandwidth_bytes_per_s == 2e9
    assert costs.ssd.bytes_per_token == kv_bytes_per_token(s.engine)
    measured = ConductorSettings(cost_profile=path, ssd_read_bytes_per_s=5e8)
    ssd = build_costs(Settings(engine=EngineSettings(model="dummy"), conductor=measured)).ssd
    assert ssd is not None and ssd.bandwidth_bytes_per_s == 5e8
    path.write_text(json.dumps({**doc, "schema": "other/9"}))
    with pytest.raises(ValueError):
        build_costs(s)


def test_kv_bytes_per_token_follow_the_model() -> None:
    dummy = EngineSettings(model="dummy")
    d = dummy.dummy
    assert kv_bytes_per_token(dummy) == 2 * d.layers * d.kv_heads * (d.hidden // d.heads) * 4
    assert kv_bytes_per_token(EngineSettings()) == 2 * 30 * 3 * 64 * 2  # bfloat16 KV
    assert kv_bytes_per_token(EngineSettings(kv="float32")) == 2 * 30 * 3 * 64 * 4


def test_no_instance_waits_add_up_to_the_bound_within_max_deliver() -> None:
    delays = [dispatch.no_instance_delay(n, 3.0, 5) for n in range(1, 6)]
    assert delays[-1] is None  # the last delivery the consumer allows: reject, not dead-letter
    waits = [d for d in delays if d is not None]
    assert sum(waits) == pytest.approx(3.0) and waits == sorted(waits)
    assert dispatch.no_instance_delay(1, 0.0, 5) is None
    assert dispatch.no_instance_delay(1, 3.0, 1) is None


def _request(**kw: object) -> ev.RequestSubmitted:
    return ev.RequestSubmitted(
        request_id="r1",
        token_ids=[1, 2, 3],
        occurred_at=datetime(2025, 1, 1, tzinfo=UTC),
        **kw,
    )


def _decision(admitted: bool) -> cd.Decision:
    return cd.Decision(
        request_id="r1", policy="early", admitted=admitted,
        reason=None if admitted else ev.RejectReason.TTFT_SLO, now=1.0, prompt_tokens=3,
        prefill_instance="p1", decode_instance="d1", local_prefix_blocks=1, prefix_tokens=32,
        predicted_ttft_s=0.5, predicted_tbt_s=0.05,
    )  # fmt: skip


def test_events_and_work_from_a_decision_have_derived_ids() -> None:
    req = _request(deadline_s=30.0, reply_to="inbox.r1")
    admitted = dispatch.admitted_event(req, _decision(True), {"k": 1})
    key = f"{req.request_id}/{req.event_id}"
    assert admitted.event_id == ev.derived_event_id(key, "decision")
    assert (admitted.prefill_instance, admitted.cached_prefix_tokens) == ("p1", 32)
    work = dispatch.prefill_work(req, _decision(True), [1, 2, 3], admitted.event_id, 16, "ns-x")
    assert (work.cached_blocks, work.local_blocks, work.attempt) == (2, 1, 1)
    assert (work.cache_namespace, work.tenant) == ("ns-x", "default")
    assert work.timing.submitted_at == req.occurred_at.timestamp()
    assert work.timing.deadline_at == work.timing.submitted_at + 30.0
    assert work.reply_to == "inbox.r1" and work.admitted_event_id == admitted.event_id
    rejected = dispatch.rejected_event(req, _decision(False), {})
    # One id whichever the decision: the broker keeps one decision of a submission.
    assert rejected.event_id == admitted.event_id
    assert (rejected.reason, rejected.stage) == (ev.RejectReason.TTFT_SLO, "admission")
    assert dispatch.prefill_work_msg_id(req) == ev.derived_event_id(key, "prefill-work-1")
    # Another request that reuses the client's event id gets ids of its own.
    other = req.model_copy(update={"request_id": "another"})
    assert dispatch.decision_event_id(other) != admitted.event_id
    assert dispatch.prefill_work_msg_id(other) != dispatch.prefill_work_msg_id(req)
    # Re-dispatch ids follow the message replaced: two DecodeWork messages of one request
    # (from two prefill attempts) never share the id of their re-dispatch.
    assert dispatch.redispatch_msg_id("m1", 2) == dispatch.redispatch_msg_id("m1", 2)
    assert dispatch.redispatch_msg_id("m1", 2) != dispatch.redispatch_msg_id("m2", 2)
    assert dispatch.redispatch_msg_id("m1", 2) != dispatch.redispatch_msg_id("m1", 3)


def test_a_request_s_cache_namespace_is_its_own_named_configured_or_its_tenant_s() -> None:
    shared = {"team-a": "common"}
    req = _request()
    assert dispatch.namespace_of(req, shared) == "tenant:default"
    a = req.model_copy(update={"tenant": "team-a"})
    b = req.model_copy(update={"tenant": "team-b"})
    assert dispatch.namespace_of(a, shared) == "shared:common"  # configured for its tenant
    assert dispatch.namespace_of(b, shared) == "tenant:team-b"  # its own
    named = b.model_copy(update={"cache_namespace": "common"})
    assert dispatch.namespace_of(named, {}) == "shared:common"  # named by the request
    # A tenant called like a shared namespace still keys apart from it.
    c = req.model_copy(update={"tenant": "common"})
    assert dispatch.namespace_of(c, {}) != dispatch.namespace_of(named, {})
    with pytest.raises(ValidationError):
        ev.RequestSubmitted(request_id="r", token_ids=[1], tenant="a b")
    with pytest.raises(ValidationError):
        ev.RequestSubmitted(request_id="r", token_ids=[1], cache_namespace="x" * 65)


def test_the_work_of_an_admission_read_back_is_the_work_of_its_decision() -> None:
    """The Conductor rebuilds the work of an admission the broker kept (`adopt`) from the
    event alone: the same work `prefill_work` built from the decision."""
    req = _request(deadline_s=30.0, reply_to="inbox.r1")
    decision = _decision(True)
    inputs = {**decision.to_dict(), "slo_class": "default"}
    admitted = dispatch.admitted_event(req, decision, inputs)
    kept = ev.RequestAdmitted.model_validate_json(admitted.to_json())  # as read back
    rebuilt = dispatch.prefill_work_of_admission(req, kept, [1, 2, 3], 16, "tenant:t")
    assert rebuilt == dispatch.prefill_work(
        req, decision, [1, 2, 3], admitted.event_id, 16, "tenant:t"
    )
    assert rebuilt.load_limit_blocks is None
    # A prefix the cost model cut short: the limit travels with the work, and back.
    cut = replace(decision, prefix_tokens=16, load_limit_blocks=1)
    admitted = dispatch.admitted_event(req, cut, {**cut.to_dict(), "slo_class": "default"})
    kept = ev.RequestAdmitted.model_validate_json(admitted.to_json())
    work = dispatch.prefill_work(req, cut, [1, 2, 3], admitted.event_id, 16, "tenant:t")
    assert (work.cached_blocks, work.load_limit_blocks) == (1, 1)
    assert dispatch.prefill_work_of_admission(req, kept, [1, 2, 3], 16, "tenant:t") == work
    # Same work: admitted to the same instances. A rejection is never "the same".
    assert dispatch.same_decision(kept, admitted)
    moved = kept.model_copy(update={"prefill_instance": "p2"})
    assert not dispatch.same_decision(moved, admitted)
    rejected = dispatch.rejected_event(req, _decision(False), {})
    assert not dispatch.same_decision(rejected, rejected)
    assert not dispatch.same_decision(rejected, admitted)


def test_cpp_settings_map_onto_the_core_config_with_the_model_s_layers() -> None:
    from mooncake.config import CppSettings
    from mooncake.core.cpp import CppConfig

    s = Settings(cpp=CppSettings(max_stages=4, chunk_tokens=256, min_gain=1.5,
                                 min_efficiency=0.8))  # fmt: skip
    want = CppConfig(max_stages=4, chunk_tokens=256, min_gain=1.5, min_efficiency=0.8, layers=30)
    assert conductor_config(s, layers=30).cpp == want
    assert conductor_config(Settings()).cpp == CppConfig()  # off: one instance per prefill
    with pytest.raises(ValidationError):
        CppSettings(max_stages=0)


def test_a_group_decision_sends_every_stage_its_work_in_one_decision() -> None:
    """A decision with a CPP group: the leader's work carries the group and the chunks
    (from the first position after the cached whole blocks, cut at equal cost), and every
    other stage gets the same work with its own stage and message id; one instance alone
    gets no stage work."""
    import dataclasses
    import itertools

    from mooncake.work import CppStage

    req = _request()
    group = dataclasses.replace(
        _decision(True), prompt_tokens=100, prefix_tokens=40, stage_instances=("p2", "p3")
    )
    tokens = list(range(1, 101))
    cost = lambda n, c: float(n * n - c * c)  # noqa: E731  (attention only: grows with n)
    work = dispatch.prefill_work(req, group, tokens, "adm", 16, "ns", cost, 20)
    assert work.cpp is not None and work.cached_blocks == 2
    assert (work.cpp.group, work.cpp.stage) == (["p1", "p2", "p3"], 0)
    chunks = work.cpp.chunks
    assert chunks[0][0] == 32 and chunks[-1][1] == 100 and len(chunks) == 4
    assert all(a == b for (_, b), (a, _) in itertools.pairwise(chunks))
    sizes = [b - a for a, b in chunks]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1]  # equal cost, not size
    stages = dispatch.stage_works(work)
    assert [(s.cpp.stage if s.cpp else None) for s in stages] == [1, 2]
    assert all(s.model_copy(update={"cpp": work.cpp}) == work for s in stages)
    ids = {dispatch.stage_work_msg_id(req, s) for s in (1, 2)} | {dispatch.prefill_work_msg_id(req)}
    assert len(ids) == 3
    alone = dispatch.prefill_work(req, _decision(True), [1, 2, 3], "adm", 16, "ns")
    assert alone.cpp is None and dispatch.stage_works(alone) == []
    # A plan that does not hold together is refused where the work arrives.
    for bad in (
        {"group": ["p1", "p2"], "stage": 2, "chunks": [(0, 5)]},
        {"group": ["p1", "p1"], "stage": 0, "chunks": [(0, 5)]},
        {"group": ["p1", "p2"], "stage": 0, "chunks": [(0, 5), (6, 9)]},
        {"group": ["p1", "p2"], "stage": 0, "chunks": [(0, 5), (5, 5)]},
    ):
        with pytest.raises(ValidationError):
            CppStage.model_validate(bad)

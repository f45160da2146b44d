"""CPP in the Conductor's choice, the cluster view's queues and the simulator's gang-scheduled
prefill groups (core/cpp.py, core/conductor.py, core/cluster.py, sim/mooncake_system.py)."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mooncake.core import cluster as cl
from mooncake.core.conductor import (
    ConductorConfig,
    ScheduleRequest,
    assignment,
    choose,
    decide,
    rejection_detail,
)
from mooncake.core.cost_model import reference_costs
from mooncake.core.cpp import CppConfig, CppPlan, cpp_ttft_s
from mooncake.core.ttft_error import TtftErrors
from mooncake.events import RejectReason
from mooncake.sim import SimConfig, run_simulation
from mooncake.sim.mooncake_system import MooncakeSystem
from mooncake.trace import TraceRequest

from helpers import cluster_view

COSTS = reference_costs()  # LLaMA3-70B on 8xA800: a 64k prompt prefills in ~40 s on one
CPP = CppConfig(max_stages=4)
CFG = ConductorConfig(ttft_slo_s=600.0, cpp=CPP)


def view(prefill: int = 4, decode: int = 1) -> cl.ClusterView:
    return cluster_view(prefill, decode)


def group_s(stages: int, prompt: int, cached: int = 0) -> float:
    plan = CppPlan.of(CPP.layers, stages, cached, prompt, CPP.chunk_tokens, COSTS.prefill.prefill_s)
    assert COSTS.activation is not None
    return cpp_ttft_s(COSTS.prefill.prefill_s, plan, CPP.layers,
                      COSTS.activation.transfer_s(CPP.chunk_tokens))  # fmt: skip


def test_a_long_prompt_on_an_idle_cluster_takes_the_whole_group() -> None:
    v = view()
    c = choose(v, ScheduleRequest("r", 65536, ()), CFG, COSTS, 0.0)
    assert c is not None and c.prefill.id == "p0" and c.stage_instances == ("p1", "p2", "p3")
    assert c.prefill_s == group_s(4, 65536) < COSTS.prefill.prefill_s(65536, 0) / 3
    assert c.ttft_s == c.queue_s + c.prefill_s + c.transfer_s
    d = decide(v, ScheduleRequest("r", 65536, ()), CFG, COSTS, 0.0)
    assert d.admitted and d.stage_instances == ("p1", "p2", "p3")
    assert json.loads(json.dumps(d.to_dict()))["stage_instances"] == ["p1", "p2", "p3"]
    # Off (the default) or short: one instance.
    off = choose(v, ScheduleRequest("r", 65536, ()), ConductorConfig(), COSTS, 0.0)
    assert off is not None and off.stage_instances == ()
    short = choose(v, ScheduleRequest("r", 1000, ()), CFG, COSTS, 0.0)
    assert short is not None and short.stage_instances == ()


def test_a_group_s_queue_is_its_last_member_s_and_every_member_is_held() -> None:
    v = view()
    # p1 busy with a short prefill: the group waits for it (cheaper than leaving it out).
    v.apply(cl.Assigned("a", "p1", "d0", 4000, 1.0, 1.0), 0.0)
    c = choose(v, ScheduleRequest("r", 65536, ()), CFG, COSTS, 0.0)
    assert c is not None and c.stage_instances
    d = decide(v, ScheduleRequest("r", 65536, ()), CFG, COSTS, 0.0)
    fact = assignment(d)
    assert fact is not None and fact.stage_instances == d.stage_instances
    members = (d.prefill_instance, *d.stage_instances)
    start = max(v.prefill[m].queue_s(0.0) for m in members)
    v.apply(fact, 0.0)
    for m in members:  # each member's queue: the group's start, then the pipeline
        assert v.prefill[m].queue_s(0.0) == start + d.prefill_s
    assert sorted(v.bound_to("p2")) == (["r"] if "p2" in members else [])
    v.apply(cl.PrefillStarted("a"), 0.0)
    v.apply(cl.PrefillFinished("a"), 1.0)
    v.apply(cl.PrefillStarted("r"), 1.0)
    assert all(v.prefill[m].running == "r" for m in members)
    v.apply(cl.PrefillFinished("r"), 1.0 + d.prefill_s)
    assert all(v.prefill[m].running is None and not v.prefill[m].queued for m in members)
    assert all(v.prefill[m].queue_s(1.0 + d.prefill_s) == 0.0 for m in members)


def test_a_refit_keeps_a_group_s_pipelined_prediction() -> None:
    v = view()
    d = decide(v, ScheduleRequest("r", 65536, ()), CFG, COSTS, 0.0)
    fact = assignment(d)
    assert fact is not None
    v.apply(fact, 0.0)
    v.reestimate(lambda p, c: 1e6, 0.0)  # a single-instance model far off
    assert v.prefill["p0"].queue_s(0.0) == d.prefill_s
    # Nor is its TTFT sample rescaled at one instance's price when a later refit comes.
    v.ttft_errors = TtftErrors(min_samples=1)
    v.apply(cl.PrefillStarted("r"), 0.0)
    v.apply(cl.PrefillFinished("r"), 2.0 * d.predicted_ttft_s)  # missed by 2x
    before = v.ttft_errors.margin(1.0)
    v.reestimate(lambda p, c: 1e6, 1.0)
    assert before == pytest.approx(2.0) and v.ttft_errors.margin(1.0) == before


def test_a_rejected_group_says_which_instances() -> None:
    tight = dataclasses.replace(CFG, ttft_slo_s=1.0)
    d = decide(view(), ScheduleRequest("r", 65536, ()), tight, COSTS, 0.0)
    assert d.reason is RejectReason.TTFT_SLO and d.stage_instances
    assert "on p0+p1+p2+p3" in rejection_detail(d)


# --- the simulator -------------------------------------------------------------------------


def sim_cfg(stages: int, prefill: int = 4) -> SimConfig:
    return SimConfig(prefill_instances=prefill, decode_instances=2, policy="none",
                     cpp_stages=stages, ttft_slo_s=600.0)  # fmt: skip


def test_one_long_prompt_prefills_in_the_pipeline_s_time() -> None:
    trace = [TraceRequest(0, 0.0, 65536, 4, ())]
    alone = run_simulation(trace, sim_cfg(1)).requests[0]
    grouped = run_simulation(trace, sim_cfg(4))
    r = grouped.requests[0]
    assert alone.ttft == COSTS.prefill.prefill_s(65536, 0)
    assert r.ttft == group_s(4, 65536) and r.prefill_stages == 4
    assert grouped.metrics["cpp_prefills"] == 1 and r.done
    assert grouped.metrics["long_prompts"]["completed"] == 1


Arrival = tuple[float, int]


@settings(max_examples=25, deadline=None)
@given(
    arrivals=st.lists(
        st.tuples(st.floats(0, 60), st.sampled_from([600, 3000, 20000, 40000, 70000])),
        min_size=1,
        max_size=25,
    ),
    stages=st.integers(2, 4),
)
def test_gangs_never_overlap_on_an_instance_and_every_request_ends(
    arrivals: list[Arrival], stages: int
) -> None:
    trace = [TraceRequest(i, t, n, 3, ()) for i, (t, n) in enumerate(sorted(arrivals))]
    runs: list[tuple[tuple[str, ...], float, float]] = []
    original = MooncakeSystem.start_prefill

    def spy(self, group, req, decision):  # type: ignore[no-untyped-def]
        took = original(self, group, req, decision)
        runs.append((group, self.loop.now, self.loop.now + took))
        return took

    MooncakeSystem.start_prefill = spy  # type: ignore[method-assign]
    try:
        res = run_simulation(trace, sim_cfg(stages))
    finally:
        MooncakeSystem.start_prefill = original  # type: ignore[method-assign]
    assert all(r.done for r in res.requests)  # no two gangs wait on each other
    assert len(runs) == len(trace)
    for inst in (f"p{i:02d}" for i in range(4)):
        spans = sorted((a, b) for g, a, b in runs if inst in g)
        assert all(b1 <= a2 + 1e-9 for (_, b1), (a2, _) in itertools.pairwise(spans))
    assert res.metrics["cpp_prefills"] == sum(1 for g, _, _ in runs if len(g) > 1)

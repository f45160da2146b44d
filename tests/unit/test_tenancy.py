"""Per-tenant admission shares (core/tenancy.py, admission.tenant_share): under contention a
tenant past its weighted fair share of the prefill work in flight is rejected first."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from mooncake.core import cluster as cl
from mooncake.core.admission import decide
from mooncake.core.conductor import ConductorConfig, ScheduleRequest, rejection_detail
from mooncake.core.cost_model import Costs, TransferModel
from mooncake.core.tenancy import TenantShares, share_verdict
from mooncake.events import RejectReason

from helpers import cluster_view


@dataclass(frozen=True)
class Linear:
    def prefill_s(self, prompt_tokens: int, cached_tokens: int) -> float:
        return (prompt_tokens - cached_tokens) * 1e-3

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        return 0.001


COSTS = Costs(Linear(), Linear(), TransferModel(1e6, 0.0, 1))
CFG = ConductorConfig(block_tokens=10, ttft_slo_s=10.0, tbt_slo_s=1.0)


def test_a_tenant_alone_or_idle_is_never_over_its_share() -> None:
    shares = TenantShares()
    assert not share_verdict({"a": 100.0}, "a", shares).over  # alone
    assert not share_verdict({"a": 0.0, "b": 5.0}, "a", shares).over  # holds nothing
    assert not share_verdict({}, "a", shares).over
    v = share_verdict({"a": 9.0, "b": 1.0}, "a", shares)
    assert v.over and (v.held_s, v.share, v.fair) == (9.0, 0.9, 0.5)
    assert not share_verdict({"a": 9.0, "b": 1.0}, "b", shares).over
    assert not share_verdict({"a": 5.0, "b": 5.0}, "a", shares).over  # exactly fair: not past
    # Weights: a weighs 9, so 90 % is its fair share.
    weighted = TenantShares(weights=(("a", 9.0),))
    assert not share_verdict({"a": 8.9, "b": 1.1}, "a", weighted).over


@given(work=st.dictionaries(st.sampled_from("abcd"), st.floats(0, 100), min_size=1))
def test_never_every_tenant_with_work_is_over(work: dict[str, float]) -> None:
    """Shares add up to one, so someone with work is always within its share: a flood never
    makes the cluster refuse every tenant."""
    holders = [t for t, s in work.items() if s > 0]
    if holders:
        assert not all(share_verdict(work, t, TenantShares()).over for t in holders)


def view() -> cl.ClusterView:
    return cluster_view(1, 1)


def flood(v: cl.ClusterView, tenant: str, n: int, seconds: float) -> None:
    for i in range(n):
        v.apply(cl.Assigned(f"{tenant}-{i}", "p0", "d0", 10, seconds, seconds, tenant=tenant), 0)


def test_under_contention_the_flooding_tenant_is_rejected_and_the_others_admitted() -> None:
    v = view()
    flood(v, "flood", 8, 0.6)  # 4.8 s queued: TTFT ~5 s of a 10 s SLO, load 0.5
    flood(v, "calm", 1, 0.2)
    assert v.tenant_prefill_work() == {"flood": 4.8, "calm": 0.2}
    req = ScheduleRequest("r", 100, (), "flood")
    d = decide("early", v, req, CFG, COSTS, 0.0)
    assert not d.admitted and d.reason is RejectReason.TENANT_QUOTA and d.stage == "admission"
    assert d.tenant == "flood" and dict(d.extra)["tenant_fair"] == 0.5
    assert "tenant flood holds 96% of the prefill work" in rejection_detail(d)
    ok = decide("early", v, ScheduleRequest("r2", 100, (), "calm"), CFG, COSTS, 0.0)
    assert ok.admitted, ok
    new = decide("early", v, ScheduleRequest("r3", 100, (), "newcomer"), CFG, COSTS, 0.0)
    assert new.admitted, new  # holds nothing yet


def test_shares_do_not_bind_without_contention_or_for_policy_none() -> None:
    v = view()
    flood(v, "flood", 2, 0.5)  # 1 s queued: load 0.11 < 0.5
    flood(v, "calm", 1, 0.1)
    req = ScheduleRequest("r", 100, (), "flood")
    assert decide("early", v, req, CFG, COSTS, 0.0).admitted
    flood(v, "flood", 10, 0.5)  # now contended
    assert decide("none", v, req, CFG, COSTS, 0.0).admitted  # no admission control at all
    assert decide("early", v, req, CFG, COSTS, 0.0).reason is RejectReason.TENANT_QUOTA
    # A contention threshold above the SLO never binds (only the SLO rejects then).
    lax = ConductorConfig(block_tokens=10, ttft_slo_s=10.0, tbt_slo_s=1.0,
                          tenants=TenantShares(contention=2.0))  # fmt: skip
    assert decide("early", v, req, lax, COSTS, 0.0).admitted


def test_work_leaves_the_tenant_s_count_when_its_prefill_ends() -> None:
    v = view()
    flood(v, "a", 2, 1.0)
    flood(v, "b", 1, 1.0)
    v.apply(cl.PrefillStarted("a-0"), 0.0)
    assert v.tenant_prefill_work() == {"a": 2.0, "b": 1.0}
    assert v.tenants_inflight == {"a": 2, "b": 1}
    v.apply(cl.PrefillFinished("a-0"), 1.0)
    assert v.tenant_prefill_work() == {"a": 1.0, "b": 1.0}
    v.apply(cl.RequestDropped("a-1"), 1.0)
    v.apply(cl.RequestDropped("b-0"), 1.0)
    assert v.tenant_prefill_work() == {}
    assert v.tenants_inflight == {"a": 1}  # a-0 decodes on: still in flight
    v.apply(cl.DecodeFinished("a-0", 3), 2.0)
    assert v.tenants_inflight == {}

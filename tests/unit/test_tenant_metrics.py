"""Per-tenant metrics: capped tenant labels, the SLO's verdict, and what one ended request
adds to each counter (the recorder counts every end once)."""

from __future__ import annotations

import uuid
from typing import Any

from prometheus_client import REGISTRY

from mooncake import metrics
from mooncake.config import SLO
from workers.recorder import observe_ended


def test_named_tenants_and_the_first_n_others_get_their_own_label() -> None:
    labels = metrics.TenantLabels(["gold", "silver"], limit=2)
    assert [labels.label(t) for t in ("a", "gold", "b", "c", "a", "silver", "d", "b")] == [
        "a", "gold", "b", "_other", "a", "silver", "_other", "b",
    ]  # fmt: skip
    assert labels.label(None) == metrics.UNKNOWN_TENANT
    # No room for others at all: only the named ones stand out.
    assert metrics.TenantLabels(["gold"], limit=0).label("a") == metrics.OTHER_TENANTS
    assert metrics.TenantLabels(["gold"], limit=0).label("gold") == "gold"


def test_a_flood_of_tenant_ids_stays_within_the_cap() -> None:
    labels = metrics.TenantLabels([], limit=32)
    seen = {labels.label(f"u-{i}") for i in range(10_000)}
    assert len(seen) == 33 and metrics.OTHER_TENANTS in seen


def test_the_slo_judges_both_latencies_and_a_missing_ttft_is_not_within() -> None:
    slo = SLO(ttft_s=2.0, tbt_s=0.1)
    assert slo.met_by(2.0, 0.1) and slo.met_by(0.5, None)  # one token: no TBT to judge
    assert not slo.met_by(2.01, 0.05) and not slo.met_by(1.0, 0.11)
    assert not slo.met_by(None, 0.05)


def _value(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _row(tenant: str | None, status: str, **kw: Any) -> dict[str, Any]:
    row = {"tenant": tenant, "status": status, "ttft_s": None, "tbt_s": None}
    return row | {"prompt_tokens": None, "cached_tokens": 0, "prefill_s": None} | kw


def test_each_ended_request_counts_its_outcome_goodput_and_tokens_under_its_label() -> None:
    t, crowd = f"t{uuid.uuid4().hex[:8]}", f"c{uuid.uuid4().hex[:8]}"
    labels = metrics.TenantLabels([t], limit=0)  # every other tenant is "_other"
    other_before = _value("mc_tenant_requests_ended_total", tenant="_other", outcome="failed")
    observe_ended(
        [
            _row(
                t,
                "completed",
                ttft_s=1.0,
                tbt_s=0.05,
                prompt_tokens=100,
                cached_tokens=64,
                prefill_s=0.5,
            ),
            _row(
                t,
                "completed",
                ttft_s=9.0,
                tbt_s=0.05,
                prompt_tokens=50,
                cached_tokens=0,
                prefill_s=0.0,
            ),
            # Never prefilled: its submission gave it a prompt length, but no hit or miss.
            _row(t, "rejected", prompt_tokens=30),
            _row(t, "cancelled", prompt_tokens=40),
            _row(crowd, "failed", prompt_tokens=10),
        ],
        SLO(ttft_s=2.0, tbt_s=0.1),
        labels,
    )
    ended = "mc_tenant_requests_ended_total"
    assert _value(ended, tenant=t, outcome="completed") == 2
    assert _value(ended, tenant=t, outcome="rejected") == 1
    assert _value("mc_tenant_goodput_total", tenant=t) == 1  # the slow one is not good
    assert _value("mc_tenant_prompt_tokens_total", tenant=t) == 150
    assert _value("mc_tenant_cached_tokens_total", tenant=t) == 64
    assert _value(ended, tenant=crowd, outcome="failed") == 0
    assert _value(ended, tenant="_other", outcome="failed") == other_before + 1

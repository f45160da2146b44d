"""`mooncake bench isolation`, CI-sized: the whole stack as `mooncake up` runs it (its own
broker and database) with the dummy model; tenant B sends tenant A's prompts and reuses none
of A's cached blocks, while A's repeat and two tenants in one shared namespace hit."""

from __future__ import annotations

import json

import pytest

from mooncake.bench import schema
from mooncake.bench.isolation import (
    CALM,
    FLOOD,
    IsolationOptions,
    figures,
    flood_figures,
    run_isolation_bench,
)
from mooncake.client import Outcome
from mooncake.config import load_settings

pytestmark = pytest.mark.e2e

ENV = {
    "MOONCAKE_ENGINE__MODEL": "dummy",
    "MOONCAKE_ENGINE__DUMMY__CONTEXT": "2048",
    "MOONCAKE_BLOCK_TOKENS": "64",
    "MOONCAKE_STORE__DRAM_BYTES": str(64 << 20),
    "MOONCAKE_LOG_LEVEL": "WARNING",
}


@pytest.mark.timeout(240)
async def test_tenants_reuse_no_blocks_of_each_other_through_the_real_roles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for k, v in ENV.items():  # the workers are `mooncake up`'s children: they read these too
        monkeypatch.setenv(k, v)
    settings = load_settings(kv_cache_bytes=64 << 20)
    # No flood phase here: its rates follow a lone request's TTFT, which the dummy model
    # makes too small to overload anything in CI time (`flood_figures` is tested below).
    opts = IsolationOptions(
        prompts=2, blocks=8, ready_timeout_s=120.0, request_timeout_s=60.0, flood=None
    )
    out = await run_isolation_bench(settings, opts, log=lambda m: print(m, flush=True))
    print(json.dumps(out))
    schema.validate("isolation", json.loads(json.dumps(out)))  # the fields a script reads
    assert out["cross_tenant_cached_tokens"] == 0, out
    assert out["same_tenant_cached_tokens"] >= 2 * 7 * 64, out  # every usable whole block
    assert out["shared_cached_tokens"] >= 2 * 7 * 64, out
    assert out["shared_first_cached_tokens"] == 0 and out["cold_cached_tokens"] == 0, out
    assert out["others_goodput_ratio"] is None and "flood" not in out  # no flood was run
    # TTFT is the dummy model's and too small to order reliably here: the checks that use it
    # are `figures`' own (below) and the full command's.
    checks = dict(out["checks"])
    checks.pop("cross-tenant TTFT cold-level")
    assert all(checks.values()), out


def test_the_figures_flag_a_cross_tenant_hit_and_a_warm_level_ttft() -> None:
    ids = {k: [f"{k}-0", f"{k}-1"] for k in ("a_cold", "cross", "a_warm", "shared_first",
                                             "shared_second")}  # fmt: skip
    ttft = {"a_cold": [2.0, 2.2], "cross": [2.1, 1.9], "a_warm": [0.3, 0.4],
            "shared_first": [2.0, 2.0], "shared_second": [0.3, 0.3]}  # fmt: skip
    cached = {rid: 0 for rids in ids.values() for rid in rids}
    for k in ("a_warm", "shared_second"):
        cached[f"{k}-0"] = cached[f"{k}-1"] = 512
    good = figures(ids, ttft, cached)
    assert good["checks_passed"] and good["cross_over_cold_ttft"] == pytest.approx(0.952, 1e-3)
    leaked = figures(ids, ttft, {**cached, "cross-1": 512})
    assert not leaked["checks"]["cross_tenant_cached_tokens == 0"]
    assert not leaked["checks_passed"] and leaked["cross_tenant_cached_tokens"] == 512
    fast = figures(ids, {**ttft, "cross": [0.4, 0.5]}, cached)
    assert not fast["checks"]["cross-tenant TTFT cold-level"] and not fast["checks_passed"]


def outcome(
    ttft: float | None, finish: str | None = "stop", rejected: str | None = None
) -> Outcome:
    o = Outcome("r", submitted_at=0.0, finish_reason=finish)
    if ttft is not None:
        o.first_token_at = ttft
        o.token_times = [ttft, ttft + 0.05]
    if rejected is not None:
        o.decision = {"type": "request.rejected", "reason": rejected}
    return o


def test_flood_figures_count_goodput_within_both_slos_and_the_flood_s_reasons() -> None:
    good, slow, gappy = outcome(1.0), outcome(40.0), outcome(1.0)
    gappy.token_times = [1.0, 1.5]  # a 0.5 s gap: over a 0.1 s TBT limit
    alone = {CALM[0]: [good, good], CALM[1]: [good, good]}
    beside = {
        CALM[0]: [good, good], CALM[1]: [good, slow],
        FLOOD: [outcome(None, None, "tenant_quota")] * 3 + [outcome(None, None, "ttft_slo"), good],
    }  # fmt: skip
    f = flood_figures(alone, beside, 30.0, 0.1, 0.5)
    assert (f["calm_goodput_alone"], f["calm_goodput_beside_flood"]) == (4, 3)
    assert f["others_goodput_ratio"] == 0.75 and not f["checks"]["others_goodput_ratio >= 0.9"]
    assert f["flood_rejections"] == {"tenant_quota": 3, "ttft_slo": 1}
    assert f["flood_goodput"] == 1 and f["checks"]["the flood's rejections carry tenant_quota"]
    kept = flood_figures(alone, {**beside, CALM[1]: [good, good]}, 30.0, 0.1, 0.5)
    assert kept["others_goodput_ratio"] == 1.0 and kept["checks"]["others_goodput_ratio >= 0.9"]
    assert (
        flood_figures(alone, {**beside, CALM[0]: [gappy, good]}, 30.0, 0.1, 0.5)[
            "calm_goodput_beside_flood"
        ]
        == 2
    )

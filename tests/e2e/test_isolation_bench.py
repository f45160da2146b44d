"""`mooncake bench isolation`, CI-sized: the whole stack as `mooncake up` runs it (its own
broker and database) with the dummy model; tenant B sends tenant A's prompts and reuses none
of A's cached blocks, while A's repeat and two tenants in one shared namespace hit."""

from __future__ import annotations

import json

import pytest

from mooncake.bench.isolation import IsolationOptions, figures, run_isolation_bench
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
    opts = IsolationOptions(prompts=2, blocks=8, ready_timeout_s=120.0, request_timeout_s=60.0)
    out = await run_isolation_bench(settings, opts, log=lambda m: print(m, flush=True))
    print(json.dumps(out))
    assert out["cross_tenant_cached_tokens"] == 0, out
    assert out["same_tenant_cached_tokens"] >= 2 * 7 * 64, out  # every usable whole block
    assert out["shared_cached_tokens"] >= 2 * 7 * 64, out
    assert out["shared_first_cached_tokens"] == 0 and out["cold_cached_tokens"] == 0, out
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

"""Scores over a finished run (PAPER.md §5, §7).

- effective request capacity at TBT threshold X: the share of *all* requests (rejected ones
  count as failures) with TTFT <= the TTFT limit and TBT score <= X;
- goodput: requests that finished inside both SLOs (the run's TTFT and TBT limits);
- hit rate: prefix tokens reused / prompt tokens, over the requests that were prefilled;
- prefill compute: summed GPU seconds of prefill (transfers excluded);
- preemptions: times a decode instance preempted a request for KV pages (all requests);
- long prompts (>= LONG_PROMPT_TOKENS): their TTFTs apart (what chunked pipeline
  parallelism is for, core/cpp.py), and how many prefills ran on a group.
"""

from __future__ import annotations

from typing import Any

from mooncake.core.quantile import quantile
from mooncake.sim.request import SimRequest, tbt_score

TBT_THRESHOLDS_MS = (100, 200, 300)
LONG_PROMPT_TOKENS = 32_768  # "prompts >= 32k tokens" (issue 19)


def _pct(xs: list[float], q: float) -> float:
    return quantile(xs, q) or 0.0


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def summarize(reqs: list[SimRequest], ttft_slo_s: float, tbt_slo_s: float) -> dict[str, Any]:
    n = len(reqs)
    done = [r for r in reqs if r.done and r.rejected is None]
    prefilled = [r for r in reqs if r.first_token_at is not None]
    ttfts = [r.ttft for r in done if r.ttft is not None]
    tbts = [tbt_score(r.gaps) for r in done]
    ok_ttft = [r.ttft is not None and r.ttft <= ttft_slo_s for r in done]
    capacity = {
        str(ms): sum(1 for ok, t in zip(ok_ttft, tbts, strict=True) if ok and t <= ms / 1e3)
        / max(n, 1)
        for ms in TBT_THRESHOLDS_MS
    }
    prompt = sum(r.prompt for r in prefilled)
    reused = sum(r.reused_tokens for r in prefilled)
    goodput = sum(1 for ok, t in zip(ok_ttft, tbts, strict=True) if ok and t <= tbt_slo_s)
    return {
        "requests": n,
        "completed": len(done),
        "rejected": sum(1 for r in reqs if r.rejected is not None),
        "wasted_prefills": sum(1 for r in reqs if r.wasted_prefill),
        "goodput": goodput,
        "effective_capacity": capacity,
        "ttft_mean_s": _mean(ttfts),
        "ttft_p50_s": _pct(ttfts, 0.5),
        "ttft_p90_s": _pct(ttfts, 0.9),
        "ttft_p99_s": _pct(ttfts, 0.99),
        "tbt_mean_s": _mean(tbts),
        "tbt_p50_s": _pct(tbts, 0.5),
        "tbt_p90_s": _pct(tbts, 0.9),
        "prefill_compute_s": sum(r.prefill_compute_s for r in prefilled),
        "hit_rate": reused / prompt if prompt else 0.0,
        "reused_tokens": reused,
        "prompt_tokens": prompt,
        "preemptions": sum(r.preemptions for r in reqs),
        "preempted_requests": sum(1 for r in reqs if r.preemptions),
        "cpp_prefills": sum(1 for r in prefilled if r.prefill_stages > 1),
        "long_prompts": _long(reqs, done),
    }


def _long(reqs: list[SimRequest], done: list[SimRequest]) -> dict[str, Any]:
    """TTFT of the completed requests whose prompt is >= LONG_PROMPT_TOKENS."""
    ttfts = [r.ttft for r in done if r.prompt >= LONG_PROMPT_TOKENS and r.ttft is not None]
    return {
        "min_prompt_tokens": LONG_PROMPT_TOKENS,
        "requests": sum(1 for r in reqs if r.prompt >= LONG_PROMPT_TOKENS),
        "completed": len(ttfts),
        "ttft_mean_s": _mean(ttfts),
        "ttft_p90_s": _pct(ttfts, 0.9),
        "ttft_p99_s": _pct(ttfts, 0.99),
    }

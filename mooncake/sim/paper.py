"""`mooncake simulate paper`: the paper's experiments (PAPER.md §3, §5, §7) on the FAST'25
traces (those shipped in the package unless told otherwise: `trace.traces_dir`), through the
simulator. Each experiment returns plain numbers; `report.py` turns them into Markdown.
`quick` replays a prefix of each trace (the first `QUICK_LIMITS` requests).

1. hit rate, global pool vs per-node local caches (FAST'25 Fig. 10): 10 prefill nodes of
   3 M tokens each; `local` = local caches behind a cache-unaware load balancer (how the
   paper's vLLM-style baselines route), `local_cache_aware` = local caches with the
   Conductor choosing by local prefix only;
2. effective request capacity (FAST'25 Fig. 7): mooncake 8P+8D vs 16 colocated instances;
3. scheduling (FAST'25 Fig. 5): random / load-balancing / local / global cache-aware, TTFT;
4. overload (arXiv v3 Table 3): 8P+8D, trace at 2x, baseline / early / predicted; plus a
   decode-bound variant (8P+2D, TBT SLO 30 ms) where the decode load matters;
5. P:D ratio on 16 nodes (synthetic trace, TTFT 10 s, TBT 100 ms);
6. chunked pipeline parallelism (arXiv v3 §5.1, core/cpp.py): 8P+8D with prefill groups of
   up to 8 against none, on every trace: TTFT of prompts >= 32k tokens (p90, p99) and of all
   requests, with no admission control, so the same requests are served on both sides and
   the means compare (under `early` the side without CPP rejects the long prompts one
   instance cannot prefill inside the TTFT SLO, and its mean leaves them out).

The experiments run in two halves of about equal work, in two processes where the machine
has two cores (`jobs`; the result's `jobs` says how many ran): the full run is ~2x the
work one core does in the 120 s it may take.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mooncake.core.admission import Policy
from mooncake.sim.metrics import LONG_PROMPT_TOKENS
from mooncake.sim.runner import SYSTEMS, SimConfig, SimResult, run_simulation
from mooncake.trace import TRACE_NAMES, TraceRequest, load_trace, trace_path
from mooncake.trace import traces_dir as resolve_traces_dir

QUICK_LIMITS = {"conversation": 1500, "synthetic": 800}
# The paper's three (PAPER.md §5), then ours (core/admission.py `forecast`).
OVERLOAD_POLICIES: tuple[Policy, ...] = ("baseline", "early", "predicted", "forecast")
Log = Callable[[str], None]
Traces = dict[str, list[TraceRequest]]


def load_traces(traces_dir: Path, quick: bool) -> Traces:
    return {
        name: load_trace(trace_path(name, traces_dir), limit=QUICK_LIMITS[name] if quick else None)
        for name in TRACE_NAMES
    }


def _r(x: float, n: int = 4) -> float:
    return round(x, n)


_RUNS: dict[tuple[int, SimConfig], dict[str, Any]] = {}


def _metrics(trace: list[TraceRequest], cfg: SimConfig) -> dict[str, Any]:
    """A run's metrics, once per (trace, config) within one `run_paper` (a run is a pure
    function of them): the scheduling and CPP experiments share their baseline."""
    key = (id(trace), cfg)
    if key not in _RUNS:
        _RUNS[key] = run_simulation(trace, cfg).metrics
    return _RUNS[key]


def hit_rate(traces: Traces, log: Log) -> dict[str, Any]:
    base = SimConfig(prefill_instances=10, decode_instances=10, policy="none")
    variants = {
        "global": base,
        "local": dataclasses.replace(base, cache_scope="local", scheduler="load-balance"),
        "local_cache_aware": dataclasses.replace(base, cache_scope="local"),
    }
    out: dict[str, Any] = {}
    for name, trace in traces.items():
        res = {k: run_simulation(trace, cfg).metrics for k, cfg in variants.items()}
        hits = {k: _r(m["hit_rate"]) for k, m in res.items()}
        pre = {k: round(m["prefill_compute_s"], 1) for k, m in res.items()}
        out[name] = {
            **hits,
            "ratio": _r(hits["global"] / max(hits["local"], 1e-9), 3),
            "ratio_cache_aware": _r(hits["global"] / max(hits["local_cache_aware"], 1e-9), 3),
            "prefill_s": pre,
            "prefill_ratio": _r(pre["global"] / max(pre["local"], 1e-9), 3),
            "prefill_ratio_cache_aware": _r(pre["global"] / max(pre["local_cache_aware"], 1e-9), 3),
        }
        log(f"hit rate {name}: {hits}")
    return out


def capacity(traces: Traces, speed: float, log: Log) -> dict[str, Any]:
    caps: dict[str, Any] = {}
    prefill: dict[str, Any] = {}
    detail: dict[str, Any] = {}
    for name, trace in traces.items():
        caps[name], prefill[name], detail[name] = {}, {}, {}
        for system in SYSTEMS:
            m = run_simulation(trace, SimConfig(system=system, speed=speed)).metrics
            caps[name][system] = {k: _r(v) for k, v in m["effective_capacity"].items()}
            prefill[name][system] = round(m["prefill_compute_s"], 1)
            detail[name][system] = {
                "ttft_mean_s": _r(m["ttft_mean_s"], 3),
                "ttft_p99_s": _r(m["ttft_p99_s"], 3),
                "tbt_p50_s": _r(m["tbt_p50_s"], 4),
                "tbt_p90_s": _r(m["tbt_p90_s"], 4),
                "rejected": m["rejected"],
                "hit_rate": _r(m["hit_rate"]),
            }
            log(f"capacity {name} {system}: {caps[name][system]}")
    return {"effective_capacity": caps, "prefill_compute_s": prefill, "capacity_detail": detail}


def scheduling(trace: list[TraceRequest], speed: float, log: Log) -> dict[str, float]:
    base = SimConfig(policy="none", speed=speed)
    variants = {
        "random": dataclasses.replace(base, scheduler="random", cache_scope="local"),
        "load-balancing": dataclasses.replace(base, scheduler="load-balance"),
        "local-cache-aware": dataclasses.replace(base, cache_scope="local"),
        "global-cache-aware": base,
    }
    out = {k: _r(_metrics(trace, c)["ttft_mean_s"], 3) for k, c in variants.items()}
    log(f"scheduling mean TTFT: {out}")
    return out


def _corr(xs: list[float], ys: list[float]) -> float:
    """Pearson correlation; 0 where a series is constant or too short. Anti-phase
    oscillation of prefill and decode load (PAPER.md §5) shows as a negative value."""
    try:
        return statistics.correlation(xs, ys)
    except statistics.StatisticsError:
        return 0.0


def _overload_row(res: SimResult) -> dict[str, Any]:
    m = res.metrics
    pre = [p for _, p, _ in res.load_samples]
    dec = [d for _, _, d in res.load_samples]
    return {
        "rejected": m["rejected"],
        "by_stage": m["rejections_by_stage"],
        "wasted_prefills": m["wasted_prefills"],
        "goodput": m["goodput"],
        "prefill_load_mean": _r(statistics.fmean(pre)) if pre else 0.0,
        "decode_load_mean": _r(statistics.fmean(dec)) if dec else 0.0,
        "decode_load_std": _r(statistics.pstdev(dec)) if dec else 0.0,
        "prefill_decode_corr": _r(_corr(pre, dec), 3),
    }


def overload(
    trace: list[TraceRequest], log: Log
) -> tuple[dict[str, Any], dict[str, list[tuple[float, float, float]]]]:
    setups = {
        "paper_8p8d": SimConfig(speed=2.0, sample_every_s=10.0),
        "decode_bound_8p2d_tbt30ms": SimConfig(
            speed=2.0, decode_instances=2, tbt_slo_s=0.03, sample_every_s=10.0
        ),
    }
    out: dict[str, Any] = {}
    samples: dict[str, list[tuple[float, float, float]]] = {}
    for label, cfg in setups.items():
        out[label] = {}
        for pol in OVERLOAD_POLICIES:
            res = run_simulation(trace, dataclasses.replace(cfg, policy=pol))
            out[label][pol] = _overload_row(res)
            samples[f"{label}_{pol}"] = res.load_samples
        log(f"overload {label}: { {p: r['rejected'] for p, r in out[label].items()} }")
    return out, samples


def pd_ratio(trace: list[TraceRequest], log: Log) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for p in (4, 6, 8, 10, 12):
        cfg = SimConfig(prefill_instances=p, decode_instances=16 - p, ttft_slo_s=10.0)
        m = run_simulation(trace, cfg).metrics
        out[f"{p}P{16 - p}D"] = {
            "goodput": m["goodput"],
            "rejected": m["rejected"],
            "ttft_mean_s": _r(m["ttft_mean_s"], 3),
            "tbt_p90_s": _r(m["tbt_p90_s"], 4),
        }
    log(f"P:D sweep: { {k: v['goodput'] for k, v in out.items()} }")
    return out


CPP_STAGES = 8


def cpp(traces: Traces, speed: float, log: Log) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, trace in traces.items():
        out[name] = {}
        for policy in ("none",):
            row: dict[str, Any] = {}
            for label, stages in (("off", 1), ("on", CPP_STAGES)):
                cfg = SimConfig(policy=policy, speed=speed, cpp_stages=stages)
                m = _metrics(trace, cfg)
                long = m["long_prompts"]
                row[label] = {
                    "ttft_mean_s": _r(m["ttft_mean_s"], 3),
                    "ttft_p99_s": _r(m["ttft_p99_s"], 3),
                    "long_ttft_p90_s": _r(long["ttft_p90_s"], 3),
                    "long_ttft_p99_s": _r(long["ttft_p99_s"], 3),
                    "long_completed": long["completed"],
                    "completed": m["completed"],
                    "rejected": m["rejected"],
                    "cpp_prefills": m["cpp_prefills"],
                }
            out[name][policy] = row
            log(f"cpp {name} {policy}: long p99 {row['off']['long_ttft_p99_s']} -> "
                f"{row['on']['long_ttft_p99_s']} s, mean {row['off']['ttft_mean_s']} -> "
                f"{row['on']['ttft_mean_s']} s")  # fmt: skip
    out["long_prompt_tokens"] = LONG_PROMPT_TOKENS
    out["max_stages"] = CPP_STAGES
    return out


Samples = dict[str, list[tuple[float, float, float]]]


def _quiet(_: str) -> None:
    return None


# The progress log, also of the half run in a forked process (a Rich console does not
# pickle; the child inherits this).
_LOG: Log = _quiet


def _part_a(traces_dir: Path, quick: bool) -> tuple[dict[str, Any], Samples]:
    """Hit rate, overload and the P:D sweep: about half of the work."""
    traces, say = load_traces(traces_dir, quick), _LOG
    out: dict[str, Any] = {"hit_rate": hit_rate(traces, say)}
    out["overload"], samples = overload(traces["conversation"], say)
    out["pd_ratio"] = pd_ratio(traces["synthetic"], say)
    return out, samples


def _part_b(traces_dir: Path, quick: bool, speed: float) -> dict[str, Any]:
    """Capacity, scheduling and CPP (the last two share runs, `_metrics`): the other half."""
    traces, say = load_traces(traces_dir, quick), _LOG
    _RUNS.clear()
    try:
        out: dict[str, Any] = {"requests": {k: len(v) for k, v in traces.items()}}
        out.update(capacity(traces, speed, say))
        out["scheduling_ttft_mean_s"] = scheduling(traces["conversation"], speed, say)
        out["cpp"] = cpp(traces, speed, say)
    finally:
        _RUNS.clear()
    return out


def default_jobs() -> int:
    """Processes `run_paper` uses: two where the machine has two cores or more."""
    return min(2, os.cpu_count() or 1)


def run_paper(
    traces_dir: Path | None = None,
    *,
    quick: bool = False,
    speed: float = 1.0,
    log: Log | None = None,
    jobs: int | None = None,
) -> tuple[dict[str, Any], Samples]:
    """Every experiment, in two halves of about equal work: with `jobs` >= 2 the first runs
    in a forked process while this one runs the second (each run is a pure function of its
    trace and configuration, so the numbers are the same either way). `traces_dir`: as
    `trace.traces_dir` takes it (None: the traces shipped in the package); one without the
    traces is a TraceError here, before any work starts."""
    global _LOG
    directory = resolve_traces_dir(traces_dir)
    _LOG = log or _quiet
    t0 = time.perf_counter()
    parallel = (jobs if jobs is not None else default_jobs()) >= 2
    if parallel:
        with multiprocessing.get_context("fork").Pool(1) as pool:
            a_async = pool.apply_async(_part_a, (directory, quick))
            b = _part_b(directory, quick, speed)
            a, samples = a_async.get()
    else:
        a, samples = _part_a(directory, quick)
        b = _part_b(directory, quick, speed)
    result: dict[str, Any] = {
        "quick": quick,
        "traces": str(directory),
        "requests": b["requests"],
        "capacity_speed": speed,
        "hit_rate": a["hit_rate"],
    }
    result.update({k: b[k] for k in ("effective_capacity", "prefill_compute_s", "capacity_detail")})
    result["scheduling_ttft_mean_s"] = b["scheduling_ttft_mean_s"]
    result["overload"] = a["overload"]
    result["rejections"] = {p: r["rejected"] for p, r in result["overload"]["paper_8p8d"].items()}
    result["pd_ratio"] = a["pd_ratio"]
    result["cpp"] = b["cpp"]
    result["jobs"] = 2 if parallel else 1
    result["elapsed_s"] = round(time.perf_counter() - t0, 2)
    return result, samples

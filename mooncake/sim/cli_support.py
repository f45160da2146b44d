"""What `mooncake simulate ...` calls: argument checks and result shaping, no typer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mooncake.config import Settings
from mooncake.core.admission import POLICIES
from mooncake.sim.paper import run_paper
from mooncake.sim.report import write_report
from mooncake.sim.runner import CACHE_SCOPES, SCHEDULERS, SYSTEMS, SimConfig, run_simulation
from mooncake.trace import load_trace, traces_dir


def run_one(
    trace: str,
    system: str,
    policy: str,
    *,
    speed: float = 1.0,
    limit: int | None = None,
    prefill: int = 8,
    decode: int = 8,
    instances: int = 16,
    seed: int = 0,
    cache_scope: str = "global",
    scheduler: str = "conductor",
    ttft_slo_s: float = 30.0,
    tbt_slo_s: float = 0.1,
    cpp_stages: int = 1,
    cpp_chunk_tokens: int = 1024,
) -> dict[str, Any]:
    """One run; every argument is checked here, so a bad one is a ValueError naming it
    (the CLI's exit code 2), never a failure deep in the simulation."""
    for name, value, allowed in (
        ("--system", system, SYSTEMS),
        ("--policy", policy, POLICIES),
        ("--cache-scope", cache_scope, CACHE_SCOPES),
        ("--scheduler", scheduler, SCHEDULERS),
    ):
        if value not in allowed:
            raise ValueError(f"{name} {value!r} is unknown; one of {', '.join(allowed)}")
    for name, num in (("--speed", speed), ("--ttft-slo", ttft_slo_s), ("--tbt-slo", tbt_slo_s)):
        if not num > 0:
            raise ValueError(f"{name} must be > 0, got {num}")
    for name, count in (
        ("--prefill", prefill), ("--decode", decode), ("--instances", instances),
        ("--cpp-stages", cpp_stages), ("--cpp-chunk", cpp_chunk_tokens),
    ):  # fmt: skip
        if count < 1:
            raise ValueError(f"{name} must be >= 1, got {count}")
    cfg = SimConfig(
        system=system,  # type: ignore[arg-type]  # checked against SYSTEMS above
        policy=policy,  # type: ignore[arg-type]
        speed=speed,
        prefill_instances=prefill,
        decode_instances=decode,
        instances=instances,
        seed=seed,
        cache_scope=cache_scope,  # type: ignore[arg-type]
        scheduler=scheduler,  # type: ignore[arg-type]
        ttft_slo_s=ttft_slo_s,
        tbt_slo_s=tbt_slo_s,
        cpp_stages=cpp_stages,
        cpp_chunk_tokens=cpp_chunk_tokens,
    )
    res = run_simulation(load_trace(trace, limit=limit), cfg)
    mooncake = system == "mooncake"
    head = {
        "system": system,
        "policy": policy if mooncake else None,
        "cache_scope": cache_scope if mooncake else None,
        "scheduler": scheduler if mooncake else None,
        "cpp_stages": cpp_stages if mooncake else None,
        "ttft_slo_s": ttft_slo_s,
        "tbt_slo_s": tbt_slo_s,
    }
    return {**head, "speed": speed, **res.metrics}


def run_paper_cli(
    *,
    quick: bool,
    out: str | None,
    traces: str | None,
    speed: float,
    log: Any = None,
    jobs: int | None = None,
    settings: Settings | None = None,
) -> dict[str, Any]:
    """`run_paper` on the traces of `--traces`, else of the `traces` setting, else the
    shipped ones: a directory without them is a TraceError (the CLI's exit code 2)."""
    directory = traces_dir(traces, settings=settings)
    result, samples = run_paper(directory, quick=quick, speed=speed, log=log, jobs=jobs)
    if out is not None:
        result["written"] = [str(p) for p in write_report(result, samples, Path(out))]
    return result

"""What `mooncake simulate ...` calls: argument checks and result shaping, no typer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mooncake.core.admission import POLICIES
from mooncake.sim.paper import TRACES, run_paper
from mooncake.sim.report import write_report
from mooncake.sim.runner import SYSTEMS, SimConfig, run_simulation
from mooncake.trace import load_trace


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
) -> dict[str, Any]:
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; one of {', '.join(SYSTEMS)}")
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; one of {', '.join(POLICIES)}")
    cfg = SimConfig(
        system=system,
        policy=policy,
        speed=speed,
        prefill_instances=prefill,
        decode_instances=decode,
        instances=instances,
        seed=seed,
    )
    res = run_simulation(load_trace(trace, limit=limit), cfg)
    head = {"system": system, "policy": policy if system == "mooncake" else None}
    return {**head, "speed": speed, **res.metrics}


def run_paper_cli(
    *,
    quick: bool,
    out: str | None,
    traces: str | None,
    speed: float,
    log: Any = None,
) -> dict[str, Any]:
    result, samples = run_paper(
        Path(traces) if traces else TRACES, quick=quick, speed=speed, log=log
    )
    if out is not None:
        result["written"] = [str(p) for p in write_report(result, samples, Path(out))]
    return result

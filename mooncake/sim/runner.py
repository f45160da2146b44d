"""One simulation: a trace slice through one system, and its metrics.

Times come from the analytic reference cost model (LLaMA3-70B on 8xA800, PAPER.md §4)
unless `SimConfig.costs` says otherwise. A run is a pure function of (trace, config):
same inputs and seed, same numbers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from mooncake.core.admission import Policy
from mooncake.core.cost_model import Costs, reference_costs
from mooncake.sim.colocated import ColocatedSystem
from mooncake.sim.loop import EventLoop
from mooncake.sim.metrics import summarize
from mooncake.sim.mooncake_system import MooncakeSystem
from mooncake.sim.request import SimRequest, from_trace
from mooncake.trace import TraceRequest

System = Literal["mooncake", "vllm", "vllm-prefix", "vllm-chunked"]
SYSTEMS: tuple[System, ...] = ("mooncake", "vllm", "vllm-prefix", "vllm-chunked")
Scheduler = Literal["conductor", "load-balance", "random"]
SCHEDULERS: tuple[Scheduler, ...] = ("conductor", "load-balance", "random")
CacheScope = Literal["global", "local"]
CACHE_SCOPES: tuple[CacheScope, ...] = ("global", "local")

TOKENS_3M_BLOCKS = 5_859  # ≈ 3 M tokens of 512-token blocks (PAPER.md §7: 3 M per node)


@dataclass(frozen=True, slots=True)
class SimConfig:
    system: System = "mooncake"
    policy: Policy = "early"
    prefill_instances: int = 8  # mooncake
    decode_instances: int = 8  # mooncake
    instances: int = 16  # colocated baselines
    speed: float = 1.0  # arrival times divided by this
    seed: int = 0
    block_tokens: int = 512
    cache_blocks_per_node: int | None = TOKENS_3M_BLOCKS  # mooncake DRAM pool, per node
    cache_scope: CacheScope = "global"
    scheduler: Scheduler = "conductor"
    balancing_threshold: float = 2.0
    # vllm-prefix: the prefix cache lives in HBM next to the running KV (≈ 1.3 M tokens).
    hbm_cache_blocks: int | None = 2_539
    kv_capacity_tokens: int | None = 1_300_000  # KV one 8xA800 node holds in HBM
    page_tokens: int = 16  # mooncake decode instances: KV page size (capacity // this pages)
    decode_max_batch: int | None = None  # mooncake decode instances: batch limit; None = none
    chunk_tokens: int = 512  # vllm-chunked token budget per iteration (vLLM 0.5 default)
    ttft_slo_s: float = 30.0
    tbt_slo_s: float = 0.1
    uniform_decode_s: float = 10.0
    sample_every_s: float = 0.0  # > 0: record (t, prefill load, decode load) (mooncake)
    # mooncake: chunked pipeline parallelism (core/cpp.py): the largest prefill group (1:
    # none) and its chunks.
    cpp_stages: int = 1
    cpp_chunk_tokens: int = 1024
    costs: Costs | None = field(default=None, compare=False)


@dataclass(slots=True)
class SimResult:
    config: SimConfig
    requests: list[SimRequest]
    metrics: dict[str, Any]
    load_samples: list[tuple[float, float, float]]


def _build(loop: EventLoop, cfg: SimConfig, costs: Costs) -> MooncakeSystem | ColocatedSystem:
    if cfg.system == "mooncake":
        return MooncakeSystem(loop, cfg, costs)
    return ColocatedSystem(
        loop,
        costs,
        instances=cfg.instances,
        cache_blocks=cfg.hbm_cache_blocks,
        prefix_cache=cfg.system == "vllm-prefix",
        chunk_tokens=cfg.chunk_tokens if cfg.system == "vllm-chunked" else None,
        kv_capacity_tokens=cfg.kv_capacity_tokens,
    )


def _sampler(
    loop: EventLoop, system: MooncakeSystem, every: float, end: float, out: list[Any]
) -> None:
    pre, dec = system.load()
    out.append((round(loop.now, 6), pre, dec))
    if loop.now + every <= end:
        loop.after(every, _sampler, loop, system, every, end, out)


def run_simulation(trace: list[TraceRequest], cfg: SimConfig) -> SimResult:
    """Replay `trace` (arrivals / cfg.speed) through cfg.system until every request ends."""
    if cfg.speed <= 0:
        raise ValueError("speed must be > 0")
    costs = cfg.costs or reference_costs()
    loop = EventLoop()
    system = _build(loop, cfg, costs)
    reqs = [from_trace(t, cfg.block_tokens) for t in trace]
    for r in reqs:
        r.arrival /= cfg.speed
        loop.at(r.arrival, system.arrive, r)
    samples: list[tuple[float, float, float]] = []
    if cfg.sample_every_s > 0 and isinstance(system, MooncakeSystem) and reqs:
        # Over the arrivals' span: a slice cut from the middle of a trace starts late, and
        # samples of the empty cluster before its first request would dilute every mean.
        first, last = min(r.arrival for r in reqs), max(r.arrival for r in reqs)
        loop.at(first, _sampler, loop, system, cfg.sample_every_s, last, samples)
    wall = time.perf_counter()
    end = loop.run()
    metrics = summarize(reqs, cfg.ttft_slo_s, cfg.tbt_slo_s)
    metrics["rejections_by_stage"] = dict(sorted(system.rejections.items()))
    metrics["took_remote_prefix"] = system.took_remote
    metrics["simulated_s"] = round(end, 3)
    metrics["events"] = loop.events
    metrics["wall_s"] = round(time.perf_counter() - wall, 3)
    return SimResult(cfg, reqs, metrics, samples)

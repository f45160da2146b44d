"""`mooncake bench conductor`: what one Conductor decision costs, in one process.

Setup: 64 prefill and 64 decode instances (one per node), LLaMA3-70B on 8xA800 reference
costs, and a global block index of >= `min_blocks` keys built from the traces' block ids
(those shipped in the package unless told otherwise: `trace.traces_dir`): the conversation
and synthetic traces are laid down `copies` times under distinct key prefixes (copy 0 of the
conversation trace uses key = str(hash_id) exactly), each request's blocks stored on one
prefill node picked by a fixed hash of its position, so popular prefixes (the shared system
prompts) end up held by many nodes, as hot blocks do.

Measured: the conversation trace's requests (copy 0, so their prefixes are in the index)
are decided in arrival order with the `early` policy (Algorithm 1 with its SLO check),
each admitted one applied to the view (queue update) and the oldest in-flight request
released once `inflight` are in flight, so queues stay realistic. `decisions_per_s` is
requests over the wall time of that loop; `p50_us` / `p99_us` time `decide` alone.

Baseline, same run: the same loop with every request's key chain left out (no prefix index
walk: plain load balancing on the same 64 + 64 instances). `ratio` = decisions_per_s /
baseline_decisions_per_s, i.e. what the KVCache-centric part costs (1.0 = free).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mooncake.core import admission
from mooncake.core import cluster as cl
from mooncake.core.conductor import ConductorConfig, ScheduleRequest, assignment
from mooncake.core.cost_model import reference_costs
from mooncake.core.quantile import quantile
from mooncake.trace import TRACE_NAMES, iter_trace, trace_path

Log = Callable[[str], None]
Loaded = list[tuple[float, int, tuple[int, ...]]]


def _load(path: Path) -> Loaded:
    return [(r.arrival_s, r.input_length, r.hash_ids) for r in iter_trace(path)]


def _build_view(
    traces: dict[str, Loaded], instances: int, min_blocks: int
) -> tuple[cl.ClusterView, int]:
    view = cl.ClusterView()
    for i in range(instances):
        view.apply(cl.InstanceJoined(f"p{i:03d}", "prefill"), 0.0)
        view.apply(cl.InstanceJoined(f"d{i:03d}", "decode"), 0.0)
    copies = 0
    while len(view.blocks) < min_blocks:
        for name, reqs in traces.items():
            prefix = "" if name == "conversation" else f"{name[0]}:"
            tag = f"{copies}/{prefix}" if copies else prefix
            for j, (_, _, ids) in enumerate(reqs):
                node = f"p{(j * 2654435761 + copies * 97) % instances:03d}"
                view.apply(cl.BlocksStored(node, tuple(f"{tag}{h}" for h in ids)), 0.0)
        copies += 1
    return view, copies


def _run(
    view: cl.ClusterView,
    reqs: list[ScheduleRequest],
    times: list[float],
    cfg: ConductorConfig,
    policy: admission.Policy,
    inflight: int,
) -> dict[str, float]:
    costs = reference_costs()
    lat: list[int] = []
    held: deque[str] = deque()
    admitted = remote = 0
    clock = time.perf_counter_ns
    start = clock()
    for r, now in zip(reqs, times, strict=True):
        t0 = clock()
        d = admission.decide(policy, view, r, cfg, costs, now)
        lat.append(clock() - t0)
        fact = assignment(d)
        if fact is not None:
            view.apply(fact, now)
            held.append(r.request_id)
            admitted += 1
            remote += d.takes_remote
        if len(held) > inflight:
            view.apply(cl.DecodeFinished(held.popleft()), now)
    wall = (clock() - start) / 1e9
    while held:  # leave the view as it was for the next run
        view.apply(cl.DecodeFinished(held.popleft()), times[-1])
    return {
        "decisions_per_s": len(reqs) / wall,
        "p50_us": (quantile(lat, 0.5) or 0.0) / 1e3,
        "p99_us": (quantile(lat, 0.99) or 0.0) / 1e3,
        "admitted": admitted,
        "took_remote_prefix": remote,
    }


def run_conductor_bench(
    *,
    requests: int = 12_000,
    instances: int = 64,
    min_blocks: int = 1_000_000,
    inflight: int = 512,
    policy: admission.Policy = "early",
    traces: Path | None = None,
    log: Log | None = None,
) -> dict[str, Any]:
    """The run (see the module doc) on the traces in `traces` (as `trace.traces_dir` takes
    it; None: the shipped ones). A directory without them is a TraceError before any work."""
    say = log or (lambda _: None)
    data = {n: _load(trace_path(n, traces)) for n in TRACE_NAMES}
    t0 = time.perf_counter()
    view, copies = _build_view(data, instances, min_blocks)
    build_s = time.perf_counter() - t0
    say(f"indexed {len(view.blocks):,} blocks ({copies} copies) in {build_s:.1f} s")
    conv = (data["conversation"] * (requests // len(data["conversation"]) + 1))[:requests]
    times = [ts for ts, _, _ in conv]
    with_keys = [
        ScheduleRequest(f"r{i}", n, tuple(str(h) for h in ids))
        for i, (_, n, ids) in enumerate(conv)
    ]
    no_keys = [ScheduleRequest(r.request_id, r.prompt_tokens, ()) for r in with_keys]
    cfg = ConductorConfig()
    main = _run(view, with_keys, times, cfg, policy, inflight)
    say(f"prefix-aware: {main['decisions_per_s']:,.0f} decisions/s")
    base = _run(view, no_keys, times, cfg, policy, inflight)
    say(f"baseline (no prefix index): {base['decisions_per_s']:,.0f} decisions/s")
    return {
        "policy": policy,
        "prefill_instances": instances,
        "decode_instances": instances,
        "indexed_blocks": len(view.blocks),
        "index_build_s": round(build_s, 2),
        "requests": requests,
        "inflight": inflight,
        "decisions_per_s": round(main["decisions_per_s"], 1),
        "p50_us": round(main["p50_us"], 1),
        "p99_us": round(main["p99_us"], 1),
        "admitted": main["admitted"],
        "took_remote_prefix": main["took_remote_prefix"],
        "baseline": "same loop, no key chains (no prefix index walk): load balancing only",
        "baseline_decisions_per_s": round(base["decisions_per_s"], 1),
        "baseline_p99_us": round(base["p99_us"], 1),
        "ratio": round(main["decisions_per_s"] / base["decisions_per_s"], 3),
        "target_decisions_per_s": 5000,
    }

"""`mooncake bench memory`: the whole system under a trace, with every role's memory held to
its bound.

1. Before anything runs, a child process builds the workers' engine: its weights' bytes (for
   the bounds) and the paged pool's decode tok/s at batch 32 over the old contiguous
   layout's (`paged_vs_contiguous_decode_b32`, `bench.memory_probe`), on a quiet machine.
2. `mooncake up`'s stack (`mooncake.stack.Stack`: embedded NATS and Postgres in a temporary
   directory, the recorder, store master, Conductor, 2 prefill, 2 decode workers, the
   gateway) with the given KV budget per engine worker, supervised as `up` does (a worker
   that exits is restarted) while every role's RSS is sampled (`bench.memwatch`).
3. Once every engine instance reports and a small request has gone through, N requests of
   the trace are replayed at k times its speed exactly as `mooncake replay` sends them
   (`replay_live`: prompts fitted to the model's context, blocks of `block_tokens`), then
   the run waits until the record holds a terminal event for each (or the timeout).

The figures come from the record (`events`): how each request ended, exactly once or not,
its TTFT and TBT (the decode worker's), preemptions; and from the watch: each role's peak
RSS against its bound (weights + KV budget + 600 MiB for prefill and decode; none for the
others), and the workers killed by SIGKILL (the OOM killer's signal) or counted by the
cgroup's OOM counter, whichever is larger.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from mooncake import events as ev
from mooncake import memory
from mooncake.bench.memory_probe import RatioOptions, run_probe
from mooncake.bench.memwatch import MemoryWatch, cgroup_oom_kills
from mooncake.bench.record import Record, read_record, rows, terminals
from mooncake.config import SLO, Settings
from mooncake.core.quantile import quantile
from mooncake.replay_live import LiveReplayOptions, fitted_trace, run_live_replay
from mooncake.stack import Stack
from mooncake.supervise import Exit
from mooncake.trace import trace_path
from mooncake.trace_fit import FitMode

Log = Callable[[str], None]
ENGINE_ROLES = ("prefill", "decode")
PAPER_TBT_LIMITS_S = (0.1, 0.2, 0.3)
DEFAULT_RATIO = RatioOptions()


@dataclass(frozen=True)
class MemoryOptions:
    speed: float = 5.0
    limit: int = 100
    # The whole conversation trace, the copy shipped in the package (the CLI passes the one
    # MOONCAKE_TRACES names, where it is set); found when the options are made, not on import.
    trace: Path = field(default_factory=lambda: trace_path("conversation"))
    fit: FitMode = FitMode.SCALE
    max_output_tokens: int = 32
    # From the first submission: the replay and the drain together. Requests that have not
    # ended by then are reported (`unended`), never left out.
    timeout_s: float = 3600.0
    # Start-up: until every engine instance reports and a small request has gone through.
    ready_timeout_s: float = 900.0
    decode_ratio: RatioOptions | None = DEFAULT_RATIO


async def run_memory_bench(
    settings: Settings, opts: MemoryOptions, log: Log = print
) -> dict[str, Any]:
    """The run (see the module doc) on a stack of its own; `settings` as `mooncake up`
    takes them (the KV budget in `kv_cache_bytes`), their broker, database and data
    directory replaced by private ones. ValueError for bad options or a bad trace."""
    from mooncake.model_info import model_spec
    from mooncake.serving.models import kv_budget_bytes

    if opts.speed <= 0 or opts.limit < 1 or opts.timeout_s <= 0:
        raise ValueError("--speed and --timeout must be > 0, --limit at least 1")
    spec = model_spec(settings.engine)
    replay = LiveReplayOptions(
        opts.trace, opts.speed, opts.limit, settings.block_tokens, opts.max_output_tokens,
        spec.vocab_size, opts.timeout_s, context_tokens=spec.context, fit=opts.fit,
        id_prefix=f"mem-{secrets.token_hex(3)}",
    )  # fmt: skip
    trace, fitted = fitted_trace(replay)  # a bad trace fails here, before anything starts
    ids = [f"{replay.id_prefix}-{i}" for i in range(len(trace))]  # as run_live_replay names them
    started = time.monotonic()
    log(f"memory: engine probe ({'with' if opts.decode_ratio else 'without'} the decode ratio)")
    probe = await asyncio.to_thread(run_probe, settings, opts.decode_ratio)
    tmp, private = private_settings(settings, "memory")
    try:
        result = await _run_stack(private, replay, ids, opts, log)
    except RuntimeError as exc:
        raise RuntimeError(f"{exc} (logs in {tmp / 'logs'})") from exc
    result["fitted"] = fitted
    result["took_s"] = round(time.monotonic() - started, 1)
    budget = kv_budget_bytes(settings)
    return keep_logs_if_failed(_report(settings, opts, probe, budget, result), tmp)


def private_settings(settings: Settings, bench: str) -> tuple[Path, Settings]:
    """A temporary directory and `settings` with a broker, database and data directory of
    their own in it (embedded ones: `Stack` starts them), for a bench's own stack."""
    from mooncake.services import free_port

    tmp = Path(tempfile.mkdtemp(prefix=f"mooncake-bench-{bench}-"))
    private = settings.model_copy(
        update={
            "data_dir": tmp,
            "nats_url": f"nats://127.0.0.1:{free_port()}",  # nothing there: embedded
            "database_url": None,  # embedded
        }
    )
    return tmp, private


def live_settings(settings: Settings, stack: Stack) -> Settings:
    """The private settings with the broker and database the started stack runs."""
    return settings.model_copy(
        update={"nats_url": stack.nats_url, "database_url": stack.database_url}
    )


def keep_logs_if_failed(result: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """Remove a passed run's directory; name a failed one's logs in its result."""
    if result["checks_passed"]:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        result["logs"] = str(tmp / "logs")
    return result


async def _run_stack(
    settings: Settings, replay: LiveReplayOptions, ids: list[str], opts: MemoryOptions, log: Log
) -> dict[str, Any]:
    """Start the stack, replay, drain, stop; the figures of the record and the watch."""
    stack = Stack(settings)
    oom_before = cgroup_oom_kills()
    watch: MemoryWatch | None = None
    try:
        log(f"memory: starting the stack under {settings.data_dir}")
        await asyncio.to_thread(stack.start_infrastructure)
        log(stack.kv_statement())
        stack.start_workers()
        watch = MemoryWatch(stack).start()
        live = live_settings(settings, stack)
        figures = await _replay_and_drain(live, stack, replay, ids, opts, log)
    finally:
        if watch is not None:
            watch.stop()
        await asyncio.to_thread(stack.stop)
    oom_after = cgroup_oom_kills()
    cgroup = None if oom_before is None or oom_after is None else oom_after - oom_before
    return {**figures, **_watch_figures(watch, cgroup)}


async def _replay_and_drain(
    settings: Settings,
    stack: Stack,
    replay: LiveReplayOptions,
    ids: list[str],
    opts: MemoryOptions,
    log: Log,
) -> dict[str, Any]:
    """Wait until the stack is ready, replay, wait for the record; the request figures."""
    from mooncake.bus.connection import connect

    ns = ev.Namespace(settings.namespace)
    engines = {w.name for w in stack.workers if w.role in ENGINE_ROLES}
    nc = await connect(settings, "bench-memory", connect_timeout=5, max_reconnect_attempts=5)
    try:
        await wait_ready(nc, ns, engines, opts.ready_timeout_s)
    finally:
        await nc.drain()
    log(f"memory: ready; replaying {opts.limit} requests of {replay.trace.name} at {opts.speed}x")
    deadline = time.monotonic() + opts.timeout_s
    try:
        summary: dict[str, Any] | None = await asyncio.wait_for(
            run_live_replay(settings, replay), opts.timeout_s
        )
    except TimeoutError:
        summary = None
    wall = summary["wall_s"] if summary else opts.timeout_s
    assert settings.database_url is not None
    log(f"memory: replay done in {wall:.0f} s; waiting for the record")
    record = await read_record(settings.database_url, ids, max(10.0, deadline - time.monotonic()))
    preempted = await preemptions(settings.database_url, ids)
    out = request_figures(ids, record, preempted, settings.slo, wall)
    out["replay_timed_out"] = summary is None
    return out


async def wait_ready(nc: NATS, ns: ev.Namespace, engines: set[str], within_s: float) -> None:
    """Until every engine instance in `engines` has sent a load report (its model is
    loaded) and a small request has gone through prefill and decode."""
    from mooncake.client import ask
    from mooncake.work import LoadReport, WorkSubjects

    seen: set[str] = set()

    async def on_load(msg: Msg) -> None:
        with contextlib.suppress(ValueError):
            seen.add(LoadReport.model_validate_json(msg.data).instance)

    sub = await nc.subscribe(WorkSubjects(ns).load("*"), cb=on_load)
    deadline = time.monotonic() + within_s
    try:
        while (left := deadline - time.monotonic()) > 0:
            if engines <= seen:
                params = ev.SamplingParams(max_tokens=2)
                wait = min(left, 60.0)
                out = await ask(nc, token_ids=[1, 2, 3], ns=ns, params=params, timeout_s=wait)
                if out.finished:
                    return
            await asyncio.sleep(0.5)
    finally:
        await sub.unsubscribe()
    raise RuntimeError(
        f"the stack was not ready within {within_s:.0f} s: engine instances reporting "
        f"{sorted(seen & engines)} of {sorted(engines)}"
    )


async def preemptions(database_url: str, ids: list[str]) -> dict[str, int]:
    """request id -> its `request.decode_preempted` events in the record."""
    found = await rows(
        database_url,
        "SELECT request_id, count(*) FROM events WHERE request_id = ANY(%s) "
        "AND type = 'request.decode_preempted' GROUP BY request_id",
        ids,
    )
    return {str(rid): int(n) for rid, n in found}


# --- figures (pure) ---------------------------------------------------------------------------


def request_figures(
    ids: list[str], record: Record, preempted: dict[str, int], slo: SLO, wall_s: float
) -> dict[str, Any]:
    """How the requests ended, from the record: counts by terminal event, reasons, the
    exactly-once check, preemptions, throughput and goodput (completed within the SLO)."""
    ends = {rid: terminals(record, rid) for rid in ids}
    last = {rid: e[-1] for rid, e in ends.items() if e}
    kinds = Counter(t.removeprefix("request.") for t, _ in last.values())
    done = [p for t, p in last.values() if t == "request.completed"]
    ttft = [float(p["ttft_s"]) for p in done if p.get("ttft_s") is not None]
    tbt = [float(p["tbt_s"]) for p in done if p.get("tbt_s") is not None]
    good = sum(1 for p in done if within_slo(p, slo))
    # The paper's three TBT thresholds (PAPER.md §7: I / II / III), each with the TTFT limit.
    by_tbt = {
        f"{limit:g}": sum(1 for p in done if within_slo(p, SLO(ttft_s=slo.ttft_s, tbt_s=limit)))
        for limit in PAPER_TBT_LIMITS_S
    }
    # How far the Conductor's TTFT prediction at admission was from what the request saw:
    # the cost model's error under this load (1 = exact; > 1: it was optimistic).
    ratios = [
        float(end["ttft_s"]) / float(adm["predicted_ttft_s"])
        for rid, (t, end) in last.items()
        if t == "request.completed" and end.get("ttft_s") is not None
        for kind, adm in record.get(rid, [])
        if kind == "request.admitted" and (adm.get("predicted_ttft_s") or 0) > 0
    ]
    reasons = {r.value for r in ev.RejectReason}
    rejected = [p for t, p in last.values() if t == "request.rejected"]
    violations = [rid for rid in ids if len(ends[rid]) != 1]
    return {
        "requests": len(ids),
        "completed": kinds["completed"],
        "rejected": kinds["rejected"],
        "failed": kinds["failed"],
        "cancelled": kinds["cancelled"],
        "unended": sum(1 for rid in ids if not ends[rid]),
        "rejected_by_reason": dict(Counter(str(p.get("reason")) for p in rejected)),
        "failed_by_reason": dict(
            Counter(str(p.get("reason")) for t, p in last.values() if t == "request.failed")
        ),
        "rejections_have_reasons": all(p.get("reason") in reasons for p in rejected),
        "terminal_exactly_once": not violations,
        "terminal_violations": violations[:10],
        "preemptions": sum(preempted.values()),
        "preempted_requests": len(preempted),
        "wall_s": round(wall_s, 1),
        "throughput_req_s": round(len(done) / wall_s, 4) if wall_s > 0 else 0.0,
        "goodput_req_s": round(good / wall_s, 4) if wall_s > 0 else 0.0,
        "within_slo": good,
        "within_ttft_slo": sum(1 for t in ttft if t <= slo.ttft_s),
        "within_slo_by_tbt_limit_s": by_tbt,
        "slo": {"ttft_s": slo.ttft_s, "tbt_s": slo.tbt_s},
        "ttft_s": {"p50": _r(quantile(ttft, 0.5)), "p90": _r(quantile(ttft, 0.9))},
        "tbt_s": {"p50": _r(quantile(tbt, 0.5)), "p90": _r(quantile(tbt, 0.9))},
        "ttft_over_predicted": {
            "p50": _r(quantile(ratios, 0.5)),
            "p90": _r(quantile(ratios, 0.9)),
            "n": len(ratios),
        },
    }


def within_slo(completed: dict[str, Any], slo: SLO) -> bool:
    """A completed request's TTFT and TBT within the SLO (a one-token answer has no TBT)."""
    return slo.met_by(completed.get("ttft_s"), completed.get("tbt_s"))


def role_figures(
    peaks: dict[str, int],
    weights_bytes: int,
    kv_budget_bytes: int,
    parts: dict[str, dict[str, int]] | None = None,
    segment_bytes: int = 0,
    settings: Settings | None = None,
) -> dict[str, dict[str, float | None]]:
    """Each role instance's peak RSS and bounds (MiB). An engine role's: issue 15's (weights
    + KV budget + 600 MiB) and the one the worker states at start (its store segment too); a
    control-plane role's (with `settings`): the one it states at start, as both. Other
    processes (a store node alone) have none. With `parts`, the peak of each part of its
    RSS (`peak_anon_mb`, ...)."""
    bound = memory.bound_bytes(weights_bytes, kv_budget_bytes) / memory.MIB
    stated = memory.bound_bytes(weights_bytes, kv_budget_bytes, segment_bytes) / memory.MIB
    out: dict[str, dict[str, float | None]] = {}
    for name, peak in sorted(peaks.items()):
        kind = name.rsplit("-", 1)[0].replace("-", "_")
        mine: float | None = None
        his: float | None = None
        if kind in ENGINE_ROLES:
            mine, his = bound, stated
        elif kind in memory.CONTROL_ROLES and settings is not None:
            mine = his = memory.control_bound_bytes(kind, settings) / memory.MIB
        role: dict[str, float | None] = {
            "peak_rss_mb": round(peak / memory.MIB, 1),
            "bound_mb": None if mine is None else round(mine, 1),
            "stated_bound_mb": None if his is None else round(his, 1),
        }
        for part, size in sorted((parts or {}).get(name, {}).items()):
            role[f"peak_{part}_mb"] = round(size / memory.MIB, 1)
        out[name] = role
    return out


def within_bound(
    role: dict[str, float | None], measure: str = "peak_rss_mb", bound_key: str = "bound_mb"
) -> bool:
    """The role's peak (RSS, or `peak_pss_mb`) within a bound; True without one."""
    peak, bound = role.get(measure), role.get(bound_key)
    return bound is None or (peak is not None and peak <= bound)


def oom_figures(exits: list[Exit], cgroup: int | None) -> dict[str, Any]:
    """OOM kills: workers that died by SIGKILL, or the cgroup's count, whichever is larger."""
    killed = sum(1 for e in exits if e.killed)
    by_cgroup = cgroup if cgroup is not None else -1
    return {
        "oom_kills": max(killed, by_cgroup),
        "oom_kills_source": "cgroup memory.events" if by_cgroup > killed else "worker returncode",
        "oom_kills_by_returncode": killed,
        "oom_kills_by_cgroup": cgroup,
    }


def _watch_figures(watch: MemoryWatch | None, cgroup: int | None) -> dict[str, Any]:
    if watch is None:
        empty = {"peaks": {}, "parts": {}, "infra_peaks": {}, "rss_samples": 0}
        return {**empty, **oom_figures([], cgroup)}
    return {
        "peaks": dict(watch.peaks),
        "parts": dict(watch.part_peaks),
        "infra_peaks": dict(watch.infra_peaks),
        "rss_samples": watch.samples,
        "worker_exits": [
            {"name": e.name, "returncode": e.returncode, "at_s": round(e.at - watch.started_at, 1)}
            for e in watch.exits
        ],
        **oom_figures(watch.exits, cgroup),
    }


def _report(
    settings: Settings,
    opts: MemoryOptions,
    probe: dict[str, Any],
    budget: int,
    run: dict[str, Any],
) -> dict[str, Any]:
    """The JSON line: the options, the run's figures, roles against their bounds, checks."""
    segment = Stack(settings).store_bytes()  # what `up` gives each engine worker's node
    roles = role_figures(
        run.pop("peaks"), probe["weights_bytes"], budget, run.pop("parts"), segment, settings
    )
    infra = {
        k: {"peak_rss_mb": round(v / memory.MIB, 1)} for k, v in run.pop("infra_peaks").items()
    }
    within = bool(roles) and all(within_bound(r) for r in roles.values())
    # What a worker holds itself: RSS counts every same-host store segment it maps, though
    # those pages exist once on the host and are the store's (its DRAM setting bounds them).
    within_private = bool(roles) and all(within_bound(r, "peak_private_mb") for r in roles.values())
    within_pss = bool(roles) and all(within_bound(r, "peak_pss_mb") for r in roles.values())
    stated_pss = bool(roles) and all(
        within_bound(r, "peak_pss_mb", "stated_bound_mb") for r in roles.values()
    )
    decode = probe.get("decode")
    checks = {
        "no_failed": run["failed"] == 0,
        "no_oom_kills": run["oom_kills"] == 0,
        "within_bounds_private": within_private,
        "within_stated_bounds_pss": stated_pss,
        "goodput_positive": run["goodput_req_s"] > 0,
        "terminal_exactly_once": run["terminal_exactly_once"],
        "rejections_have_reasons": run["rejections_have_reasons"],
    }
    return {
        "model": settings.engine.model,
        "kv_budget_bytes": budget,
        "speed": opts.speed,
        "trace": opts.trace.name,
        "max_output_tokens": opts.max_output_tokens,
        "admission_policy": settings.admission_policy,
        "cost_profile": str(c) if (c := settings.conductor.cost_profile) else None,
        **run,
        "roles": roles,
        "infrastructure": infra,
        "within_bounds": within,
        # The same with RssAnon + RssFile: the shared store segments left out.
        "within_bounds_private": within_private,
        # The same with PSS: a shared page (the store's segments) as a share per mapper.
        "within_bounds_pss": within_pss,
        # PSS against what each worker states at start (its store segment included).
        "within_stated_bounds_pss": stated_pss,
        "store_segment_mb": round(segment / memory.MIB, 1),
        "weights_mb": round(probe["weights_bytes"] / memory.MIB, 1),
        "paged_vs_contiguous_decode_b32": decode["ratio"] if decode else None,
        "decode_b32": decode,
        "checks": checks,
        "checks_passed": all(checks.values()),
    }


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None else round(x, nd)

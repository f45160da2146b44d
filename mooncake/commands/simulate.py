"""`mooncake simulate ...`: the paper's systems replayed on traces in the simulator."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer

from mooncake.cli_common import console, err, print_result, settings_or_exit, trace_errors_exit

simulate_app = typer.Typer(
    help="Discrete-event simulation of the paper's systems on traces", no_args_is_help=True
)


@simulate_app.command("run")
def simulate_run(
    trace: Annotated[str, typer.Option(help="Trace JSONL file")],
    system: Annotated[str, typer.Option(help="mooncake|vllm|vllm-prefix|vllm-chunked")] = (
        "mooncake"
    ),
    policy: Annotated[
        str,
        typer.Option(help="Admission policy: none, baseline, early, predicted or forecast"),
    ] = "early",
    cache_scope: Annotated[
        str,
        typer.Option(
            help="mooncake: global (one pool, remote prefixes fetched) or local (each prefill "
            "node reuses only its own DRAM)"
        ),
    ] = "global",
    scheduler: Annotated[
        str,
        typer.Option(
            help="mooncake: conductor (Algorithm 1), load-balance (least queue, no prefix "
            "matching) or random"
        ),
    ] = "conductor",
    ttft_slo: Annotated[float, typer.Option(help="TTFT SLO in seconds")] = 30.0,
    tbt_slo: Annotated[float, typer.Option(help="TBT SLO in seconds")] = 0.1,
    speed: Annotated[float, typer.Option(help="Replay speed factor")] = 1.0,
    limit: Annotated[int | None, typer.Option(help="First N requests only")] = None,
    prefill: Annotated[int, typer.Option(help="mooncake prefill instances")] = 8,
    decode: Annotated[int, typer.Option(help="mooncake decode instances")] = 8,
    instances: Annotated[int, typer.Option(help="Colocated baseline instances")] = 16,
    seed: Annotated[int, typer.Option()] = 0,
    cpp_stages: Annotated[
        int,
        typer.Option(
            help="mooncake: the largest group of prefill instances one prompt is prefilled "
            "by (chunked pipeline parallelism); 1: none"
        ),
    ] = 1,
    cpp_chunk: Annotated[int, typer.Option(help="Tokens of a CPP chunk")] = 1024,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Replay one trace through one system configuration and print its metrics."""
    from mooncake.sim.cli_support import run_one

    try:
        result = run_one(
            trace, system, policy, speed=speed, limit=limit, prefill=prefill,
            decode=decode, instances=instances, seed=seed, cache_scope=cache_scope,
            scheduler=scheduler, ttft_slo_s=ttft_slo, tbt_slo_s=tbt_slo,
            cpp_stages=cpp_stages, cpp_chunk_tokens=cpp_chunk,
        )  # fmt: skip
    except (ValueError, OSError) as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from exc
    print_result("simulate run", result, as_json)


@simulate_app.command("paper")
def simulate_paper(
    quick: Annotated[bool, typer.Option("--quick", help="Trace prefixes only (< 60 s)")] = False,
    as_json: Annotated[bool, typer.Option("--json")] = False,
    out: Annotated[str | None, typer.Option(help="Write Markdown tables + CSV here")] = None,
    traces: Annotated[
        str | None,
        typer.Option(
            help="Directory of conversation_trace.jsonl and synthetic_trace.jsonl (each may "
            "be .jsonl.gz); default: MOONCAKE_TRACES, else the traces shipped in the package"
        ),
    ] = None,
    speed: Annotated[float, typer.Option(help="Speed of the capacity runs")] = 1.0,
    jobs: Annotated[
        int | None,
        typer.Option(min=1, help="Processes (default: 2 where there are two cores, else 1)"),
    ] = None,
) -> None:
    """Regenerate the paper's experiments (PAPER.md §3, §5, §7) in one command."""
    from mooncake.sim.cli_support import run_paper_cli

    settings = settings_or_exit()
    with trace_errors_exit("simulate paper"):
        result = run_paper_cli(
            quick=quick, out=out, traces=traces, speed=speed, log=err.print, jobs=jobs,
            settings=settings,
        )  # fmt: skip
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        console.print_json(json.dumps(result))

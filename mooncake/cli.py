"""The `mooncake` command (typer): up, demo, worker, submit, db, bench."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import time
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from mooncake.config import Settings, load_settings

if TYPE_CHECKING:
    from mooncake.events import SamplingParams

app = typer.Typer(help="mooncake: KVCache-centric disaggregated LLM serving", no_args_is_help=True)
db_app = typer.Typer(help="The Postgres record: migrations, checks, rebuilds", no_args_is_help=True)
bench_app = typer.Typer(
    help="Benchmarks that measure a baseline in the same run", no_args_is_help=True
)
app.add_typer(db_app, name="db")
app.add_typer(bench_app, name="bench")
profile_app = typer.Typer(help="Profiles the cost model fits", no_args_is_help=True)
app.add_typer(profile_app, name="profile")
simulate_app = typer.Typer(
    help="Discrete-event simulation of the paper's systems on traces", no_args_is_help=True
)
app.add_typer(simulate_app, name="simulate")
console = Console()
err = Console(stderr=True)

WORKERS = ("recorder", "conductor")


class Until(StrEnum):
    ADMITTED = "admitted"
    FINISHED = "finished"


def _settings() -> Settings:
    try:
        return load_settings()
    except Exception as exc:  # a bad MOONCAKE_* value: say which, do not trace back
        err.print(f"[red]invalid configuration:[/red] {exc}")
        raise typer.Exit(2) from exc


def _require_db(settings: Settings) -> str:
    if not settings.database_url:
        err.print("[red]no database:[/red] set MOONCAKE_DATABASE_URL or run `mooncake up` first")
        raise typer.Exit(2)
    return settings.database_url


# --- up / demo / worker ----------------------------------------------------------------------


def _status_table(stack: object) -> Table:
    table = Table(title="mooncake")
    for col in ("component", "address", "state"):
        table.add_column(col)
    for row in stack.status_rows():  # type: ignore[attr-defined]
        table.add_row(*row)
    return table


@app.command()
def up(
    workers: Annotated[bool, typer.Option(help="Start the worker processes")] = True,
) -> None:
    """Start what is missing (broker, database), migrate, start every worker; Ctrl-C stops."""
    from mooncake.stack import Stack

    settings = _settings()
    stack = Stack(settings)
    try:
        with console.status("starting infrastructure"):
            stack.start_infrastructure()
        if workers:
            stack.start_workers(WORKERS)
        console.print(_status_table(stack))
        console.print(
            f'logs in {settings.data_dir / "logs"}; `mooncake submit "hello"` in another '
            "terminal; Ctrl-C to stop"
        )
        _wait_for_signal(stack)
    finally:
        with console.status("stopping"):
            stack.stop()
        console.print("stopped")


def _wait_for_signal(stack: object) -> None:
    stopping = False

    def _stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    while not stopping:
        time.sleep(0.5)
        for w in stack.workers:  # type: ignore[attr-defined]
            if not w.running:
                err.print(f"[yellow]{w.name} exited ({w.proc.returncode}); restarting[/yellow]")
                stack.restart(w)  # type: ignore[attr-defined]


@app.command()
def demo(
    requests: Annotated[int, typer.Option(help="Requests in the burst")] = 500,
) -> None:
    """Run the whole system on the embedded default, push requests through it, show the
    record, and shut down."""
    from mooncake.demo import run_demo

    settings = _settings()
    ok = run_demo(settings, console, requests=requests)
    raise typer.Exit(0 if ok else 1)


@app.command()
def worker(
    role: Annotated[str, typer.Argument(help=f"One of: {', '.join(WORKERS)}")],
    instance: Annotated[str | None, typer.Option(help="Instance id")] = None,
) -> None:
    """Run one worker role against an existing broker and database."""
    settings = _settings()
    from workers.runtime import configure_logging

    configure_logging(settings.log_level)
    if role == "recorder":
        from workers import recorder as mod
    elif role == "conductor":
        from workers import conductor as mod  # type: ignore[no-redef]
    else:
        err.print(f"[red]unknown role {role!r}[/red]; expected one of {', '.join(WORKERS)}")
        raise typer.Exit(2)
    asyncio.run(mod.main(settings, instance))


# --- submit -----------------------------------------------------------------------------------


@app.command()
def submit(
    prompt: Annotated[str, typer.Argument(help="The prompt text")],
    max_tokens: Annotated[int, typer.Option(min=1)] = 64,
    temperature: Annotated[float, typer.Option(min=0.0)] = 0.0,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the outcome")] = 30.0,
    raw: Annotated[bool, typer.Option("--json", help="Print each reply as JSON")] = False,
    until: Annotated[
        Until, typer.Option(help="Stop at the admission decision, or when the request ends")
    ] = Until.FINISHED,
) -> None:
    """Publish a request to mc.req.submitted and print what comes back."""
    from mooncake.events import SamplingParams

    settings = _settings()
    if not prompt.strip():
        err.print("[red]the prompt is empty[/red]")
        raise typer.Exit(2)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
    asyncio.run(_submit(settings, prompt, params, timeout, raw, until))


async def _submit(
    settings: Settings,
    prompt: str,
    params: SamplingParams,
    wait_s: float,
    raw: bool,
    until: Until,
) -> None:
    import nats

    from mooncake.client import TERMINAL_TYPES
    from mooncake.client import submit as do_submit
    from mooncake.events import Namespace

    stop_at = TERMINAL_TYPES | {"request.admitted"} if until is Until.ADMITTED else TERMINAL_TYPES

    try:
        nc = await nats.connect(settings.nats_url, connect_timeout=3, max_reconnect_attempts=1)
    except Exception as exc:
        err.print(
            f"[red]cannot reach NATS at {settings.nats_url}:[/red] {exc}; is `mooncake up` running?"
        )
        raise typer.Exit(1) from exc
    got = False
    try:
        ns = Namespace(settings.namespace)
        replies = do_submit(
            nc,
            prompt,
            ns=ns,
            params=params,
            timeout_s=wait_s,
            until=stop_at,
        )
        async for body in replies:
            got = True
            if raw:
                console.print_json(json.dumps(body))
            else:
                _print_reply(body)
    finally:
        await nc.close()
    if not got:
        err.print(f"[yellow]no reply within {wait_s:.0f}s[/yellow]")
        raise typer.Exit(1)


def _print_reply(body: dict[str, object]) -> None:
    kind = str(body.get("type", "?")).removeprefix("request.")
    rid = body.get("request_id")
    if kind == "rejected":
        console.print(f"[red]{rid} rejected[/red]: {body.get('reason')} {body.get('detail', '')}")
    else:
        extras = {
            k: v
            for k, v in body.items()
            if k in ("policy", "prefill_instance", "decode_instance", "text")
        }
        console.print(f"[green]{rid} {kind}[/green] {extras}")


# --- db ---------------------------------------------------------------------------------------


@db_app.command("upgrade")
def db_upgrade(revision: str = "head") -> None:
    """Apply migrations."""
    from mooncake.db.engine import upgrade

    upgrade(_require_db(_settings()), revision)
    console.print(f"database at {revision}")


@db_app.command("check")
def db_check() -> None:
    """Fail if the models and migrations have drifted (alembic check)."""
    from alembic.util.exc import CommandError

    from mooncake.db.engine import check

    try:
        check(_require_db(_settings()))
    except CommandError as exc:
        err.print(f"[red]drift:[/red] {exc}")
        raise typer.Exit(1) from exc
    console.print("models and migrations agree")


@db_app.command("rebuild")
def db_rebuild(
    check_only: Annotated[
        bool, typer.Option("--check", help="Only compare, write nothing")
    ] = False,
) -> None:
    """Drop and rebuild every projection from `events` (or, with --check, compare only)."""
    from mooncake.db import rebuild as rb
    from mooncake.db.engine import async_engine

    url = _require_db(_settings())

    async def go() -> int:
        engine = async_engine(url)
        try:
            if check_only:
                diffs = await rb.verify(engine)
                for d in diffs:
                    console.print(f"[red]{d}[/red]")
                console.print(
                    "projections match the events log" if not diffs else f"{len(diffs)} differences"
                )
                return 1 if diffs else 0
            counts = await rb.rebuild(engine)
            console.print(f"rebuilt {counts}")
            return 0
        finally:
            await engine.dispose()

    raise typer.Exit(asyncio.run(go()))


# --- bench ------------------------------------------------------------------------------------


@bench_app.command("bus")
def bench_bus(
    events: Annotated[int, typer.Option(help="Events for the recorder throughput run")] = 20000,
    relays: Annotated[int, typer.Option(help="Messages through each 3-hop relay")] = 500,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Recorder throughput into Postgres and 3-hop relay latency vs bare nats-py."""
    from mooncake.bench.bus import run_bus_bench

    settings = _settings()
    result = asyncio.run(run_bus_bench(settings, events=events, relays=relays, log=err))
    _print_result("bench bus", result, as_json)


@bench_app.command("conductor")
def bench_conductor(
    requests: Annotated[int, typer.Option(help="Decisions to time (conversation trace)")] = 12000,
    instances: Annotated[int, typer.Option(help="Prefill and decode instances, each")] = 64,
    min_blocks: Annotated[int, typer.Option(help="Keys in the global block index")] = 1_000_000,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Conductor decisions/s and p99 latency vs the same loop without the prefix index."""
    from mooncake.bench.conductor import run_conductor_bench

    result = run_conductor_bench(
        requests=requests, instances=instances, min_blocks=min_blocks, log=err.print
    )
    _print_result("bench conductor", result, as_json)


@bench_app.command("engine")
def bench_engine(
    prefill_tokens: Annotated[int, typer.Option(help="Prompt tokens for the prefill run")] = 512,
    decode_tokens: Annotated[int, typer.Option(help="Tokens per decode run")] = 64,
    reps: Annotated[int, typer.Option(min=1, help="Timed repetitions (median)")] = 5,
    threads: Annotated[int | None, typer.Option(help="torch threads (default: torch's)")] = None,
    device: Annotated[str, typer.Option(help="torch device")] = "cpu",
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """SmolLM2 prefill/decode speed vs transformers' LlamaForCausalLM, batch-8 decode, and
    the prefill speedup of a cached prefix."""
    from mooncake.bench.engine import run_engine_bench

    result = run_engine_bench(
        prefill_tokens=prefill_tokens,
        decode_tokens=decode_tokens,
        reps=reps,
        threads=threads,
        device=device,
        log=err.print,
    )
    _print_result("bench engine", result, as_json)


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}") from exc


@profile_app.command("engine")
def profile_engine_cmd(
    out: Annotated[str, typer.Option(help="Where to write the profile JSON")] = "profile.json",
    dummy: Annotated[bool, typer.Option(help="A random model of the shape below")] = False,
    layers: Annotated[int, typer.Option(help="--dummy: layers")] = 30,
    hidden: Annotated[int, typer.Option(help="--dummy: hidden size")] = 576,
    heads: Annotated[int, typer.Option(help="--dummy: attention heads")] = 9,
    kv_heads: Annotated[int, typer.Option(help="--dummy: KV heads")] = 3,
    ffn: Annotated[int, typer.Option(help="--dummy: FFN size")] = 1536,
    vocab: Annotated[int, typer.Option(help="--dummy: vocabulary")] = 49152,
    context: Annotated[int, typer.Option(help="--dummy: context length")] = 8192,
    prompts: Annotated[str, typer.Option(help="Prompt lengths")] = "256,512,1024,2048",
    cached: Annotated[str, typer.Option(help="Cached prefix lengths")] = "0,256,512,1024,1536",
    batches: Annotated[str, typer.Option(help="Decode batch sizes")] = "1,2,4,8",
    contexts: Annotated[str, typer.Option(help="Decode contexts")] = "128,512,1024,2048",
    block_tokens: Annotated[int, typer.Option(min=1, help="KV block size")] = 256,
    reps: Annotated[int, typer.Option(min=1, help="Timed repetitions (median)")] = 3,
    threads: Annotated[int | None, typer.Option(help="torch threads")] = None,
    device: Annotated[str, typer.Option(help="torch device")] = "cpu",
) -> None:
    """Time prefill over (prompt, cached prefix) and decode steps over (batch, context) on
    the real engine (SmolLM2 unless --dummy); write a mooncake.profile/1 JSON."""
    from pathlib import Path

    import torch

    from mooncake.engine import Engine, EngineError, ModelSpec, dummy_model
    from mooncake.engine.gguf_loader import load_gguf, smollm2_path
    from mooncake.engine.profile import profile_engine

    if threads is not None:
        torch.set_num_threads(threads)
    try:
        if dummy:
            spec = ModelSpec(vocab, hidden, layers, heads, kv_heads, ffn, context)
            model, tokenizer = dummy_model(spec, device=device), None
            name = f"dummy-l{layers}-h{hidden}-a{heads}-kv{kv_heads}-f{ffn}-v{vocab}"
        else:
            loaded = load_gguf(smollm2_path(), device=device)
            model, tokenizer, name = loaded.model, loaded.tokenizer, loaded.name
        engine = Engine(model, tokenizer, block_tokens=block_tokens)
        doc = profile_engine(
            engine,
            model_name=name,
            prompts=_int_list(prompts),
            cached=_int_list(cached),
            batches=_int_list(batches),
            contexts=_int_list(contexts),
            reps=reps,
            log=err.print,
        )
    except EngineError as exc:
        err.print(f"[red]profile failed:[/red] {exc}")
        raise typer.Exit(2) from exc
    Path(out).write_text(json.dumps(doc, indent=1) + "\n")
    err.print(f"wrote {out}: {len(doc['prefill'])} prefill and {len(doc['decode'])} decode points")


def _print_result(title: str, result: dict[str, object], as_json: bool) -> None:
    """One JSON object on stdout (for scripts), or a table for people."""
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
        return
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value")
    for k, v in result.items():
        table.add_row(k, f"{v:.3f}" if isinstance(v, float) else str(v))
    console.print(table)


# --- simulate ---------------------------------------------------------------------------------


@simulate_app.command("run")
def simulate_run(
    trace: Annotated[str, typer.Option(help="Trace JSONL file")],
    system: Annotated[str, typer.Option(help="mooncake|vllm|vllm-prefix|vllm-chunked")] = (
        "mooncake"
    ),
    policy: Annotated[str, typer.Option(help="Admission: none|baseline|early|predicted")] = (
        "early"
    ),
    speed: Annotated[float, typer.Option(help="Replay speed factor")] = 1.0,
    limit: Annotated[int | None, typer.Option(help="First N requests only")] = None,
    prefill: Annotated[int, typer.Option(help="mooncake prefill instances")] = 8,
    decode: Annotated[int, typer.Option(help="mooncake decode instances")] = 8,
    instances: Annotated[int, typer.Option(help="Colocated baseline instances")] = 16,
    seed: Annotated[int, typer.Option()] = 0,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Replay one trace through one system configuration and print its metrics."""
    from mooncake.sim.cli_support import run_one

    try:
        result = run_one(
            trace, system, policy, speed=speed, limit=limit, prefill=prefill,
            decode=decode, instances=instances, seed=seed,
        )  # fmt: skip
    except (ValueError, OSError) as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from exc
    _print_result("simulate run", result, as_json)


@simulate_app.command("paper")
def simulate_paper(
    quick: Annotated[bool, typer.Option("--quick", help="Trace prefixes only (< 60 s)")] = False,
    as_json: Annotated[bool, typer.Option("--json")] = False,
    out: Annotated[str | None, typer.Option(help="Write Markdown tables + CSV here")] = None,
    traces: Annotated[str | None, typer.Option(help="Traces dir (default ../shared)")] = None,
    speed: Annotated[float, typer.Option(help="Speed of the capacity runs")] = 1.0,
) -> None:
    """Regenerate the paper's experiments (PAPER.md §3, §5, §7) in one command."""
    from mooncake.sim.cli_support import run_paper_cli

    result = run_paper_cli(quick=quick, out=out, traces=traces, speed=speed, log=err.print)
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        console.print_json(json.dumps(result))


def main() -> None:  # pragma: no cover - console entry point
    logging.basicConfig(level=logging.WARNING)
    app()


if __name__ == "__main__":
    app()

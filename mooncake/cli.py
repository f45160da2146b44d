"""The `mooncake` command (typer): up, demo, worker, submit, db; bench, profile and simulate
live in `mooncake.commands`."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from collections.abc import AsyncIterator, Callable
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.live import Live

from mooncake.cli_common import KV_CACHE_HELP, console, err, settings_or_exit
from mooncake.commands.bench import bench_app
from mooncake.commands.profile import profile_app
from mooncake.commands.replay import replay
from mooncake.commands.simulate import simulate_app
from mooncake.config import Settings

if TYPE_CHECKING:
    from mooncake.client import InOrderText, Outcome
    from mooncake.events import SamplingParams
    from mooncake.stack import Stack

app = typer.Typer(help="mooncake: KVCache-centric disaggregated LLM serving", no_args_is_help=True)
db_app = typer.Typer(help="The Postgres record: migrations, checks, rebuilds", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(bench_app, name="bench")
app.add_typer(profile_app, name="profile")
app.add_typer(simulate_app, name="simulate")
app.command("replay")(replay)

WORKERS = ("recorder", "store-master", "conductor", "prefill", "decode", "store-node", "gateway")


class Until(StrEnum):
    ADMITTED = "admitted"
    FINISHED = "finished"


def _require_db(settings: Settings) -> str:
    if not settings.database_url:
        err.print("[red]no database:[/red] set MOONCAKE_DATABASE_URL or run `mooncake up` first")
        raise typer.Exit(2)
    return settings.database_url


# --- up / demo / worker ----------------------------------------------------------------------


@app.command()
def up(
    workers: Annotated[bool, typer.Option(help="Start the worker processes")] = True,
    kv_cache_bytes: Annotated[str | None, typer.Option(help=KV_CACHE_HELP)] = None,
    database_url: Annotated[
        str | None,
        typer.Option(
            help="An existing Postgres (MOONCAKE_DATABASE_URL); default: an embedded "
            "one under the data directory"
        ),
    ] = None,
    metrics: Annotated[
        bool, typer.Option(help="Each worker serves Prometheus /metrics (ports in the table)")
    ] = True,
) -> None:
    """Start the broker (unless one answers at MOONCAKE_NATS_URL) and the database (unless
    --database-url names one), migrate, start every worker; Ctrl-C stops."""
    from mooncake.config import RUNTIME_ENV
    from mooncake.stack import Stack, other_system, running_up, status_table

    if RUNTIME_ENV.exists():  # what an `up` in this directory wrote for `submit` to find it
        if (pid := running_up(RUNTIME_ENV)) is not None:
            err.print(f"[red]`mooncake up` (pid {pid}) already runs here[/red] ({RUNTIME_ENV}); "
                      "stop it first")  # fmt: skip
            raise typer.Exit(1)
        RUNTIME_ENV.unlink()  # an `up` that was killed left it: its addresses are dead
        err.print(f"[yellow]removed {RUNTIME_ENV}, left by an `up` that did not stop[/yellow]")
    settings = settings_or_exit(kv_cache_bytes=kv_cache_bytes, database_url=database_url)
    stack = Stack(settings, metrics=metrics)
    try:
        with console.status("starting infrastructure"):
            stack.start_infrastructure()
        if workers and stack.nats is None and (why := other_system(settings, stack.nats_url)):
            err.print(f"[red]not started:[/red] {why}", soft_wrap=True)
            raise typer.Exit(1)
        if workers:
            console.print(stack.kv_statement())
            stack.start_workers()
            stack.watch_index()  # the table's `index` column
        console.print(
            f'logs in {settings.data_dir / "logs"}; `mooncake submit "hello"` in another '
            "terminal; Ctrl-C to stop"
        )
        if console.is_terminal:  # a live table, refreshed every second
            with Live(status_table(stack), console=console, refresh_per_second=1) as live:
                _wait_for_signal(stack, lambda: live.update(status_table(stack)))
        else:  # a pipe or a log file: the table now, and again at shutdown, a line a row
            wide = Console(file=console.file, width=max(console.width, 200))
            wide.print(status_table(stack))
            _wait_for_signal(stack)
            wide.print(status_table(stack))
    finally:
        with console.status("stopping"):
            stack.stop()
        console.print("stopped")


def _wait_for_signal(stack: Stack, tick: Callable[[], None] = lambda: None) -> None:
    from mooncake.supervise import restart_exited

    stopping = False

    def _stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    while not stopping:
        time.sleep(0.5)
        for e in restart_exited(stack):
            err.print(f"[yellow]{e.name} exited ({e.returncode}); restarted[/yellow]")
        tick()


@app.command()
def demo(
    requests: Annotated[
        int, typer.Option(min=1, max=200, help="Trace requests to replay (conversation trace)")
    ] = 20,
) -> None:
    """Run the whole system on the embedded default: three prompts answered by SmolLM2, a
    slice of the conversation trace replayed, the record shown; then shut down."""
    from mooncake.demo import run_demo

    settings = settings_or_exit()
    ok = run_demo(settings, console, requests=requests)
    raise typer.Exit(0 if ok else 1)


@app.command()
def worker(
    role: Annotated[str, typer.Argument(help=f"One of: {', '.join(WORKERS)}")],
    instance: Annotated[str | None, typer.Option(help="Instance id")] = None,
    kv_cache_bytes: Annotated[str | None, typer.Option(help=KV_CACHE_HELP)] = None,
) -> None:
    """Run one worker role against an existing broker and database."""
    settings = settings_or_exit(kv_cache_bytes=kv_cache_bytes)
    from workers.runtime import configure_logging

    configure_logging(settings.log_level)
    if role == "recorder":
        from workers import recorder as mod
    elif role == "conductor":
        from workers import conductor as mod  # type: ignore[no-redef]
    elif role == "store-master":
        from workers import store_master as mod  # type: ignore[no-redef]
    elif role == "store-node":
        from workers import store_node as mod  # type: ignore[no-redef]
    elif role == "prefill":
        from workers import prefill as mod  # type: ignore[no-redef]
    elif role == "decode":
        from workers import decode as mod  # type: ignore[no-redef]
    elif role == "gateway":
        from workers import gateway as mod  # type: ignore[no-redef]
    else:
        err.print(f"[red]unknown role {role!r}[/red]; expected one of {', '.join(WORKERS)}")
        raise typer.Exit(2)
    try:
        asyncio.run(mod.main(settings, instance))
    except ValueError as exc:  # a configuration the role cannot run with (a missing secret)
        err.print(f"[red]{role}: {exc}[/red]")
        raise typer.Exit(2) from exc


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

    settings = settings_or_exit()
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
    from mooncake.bus.connection import connect
    from mooncake.client import (
        TERMINAL_TYPES,
        InOrderText,
        Outcome,
        SystemDown,
        check_admitting,
        fill_from_copy,
        new_request_id,
    )
    from mooncake.client import submit as do_submit
    from mooncake.events import Namespace

    stop_at = TERMINAL_TYPES | {"request.admitted"} if until is Until.ADMITTED else TERMINAL_TYPES

    try:
        nc = await connect(settings, "cli-submit", connect_timeout=3, max_reconnect_attempts=1)
    except Exception as exc:
        err.print(
            f"[red]cannot reach NATS at {settings.nats_url}:[/red] {exc}; is `mooncake up` running?"
        )
        raise typer.Exit(1) from exc
    try:
        ns = Namespace(settings.namespace)
        try:
            await check_admitting(nc, ns)
        except SystemDown as exc:  # published now, it would wait unseen for a later `up`
            err.print(f"[red]not submitted:[/red] {exc}", soft_wrap=True)
            raise typer.Exit(1) from exc
        out = Outcome(new_request_id())
        replies = do_submit(
            nc, prompt, ns=ns, params=params, request_id=out.request_id, timeout_s=wait_s,
            until=stop_at,
        )  # fmt: skip
        text = InOrderText(out)
        got = await _follow(replies, out, text, raw)
        if out.incomplete:
            # Reply chunks are at most once: read what did not arrive (the final chunk too)
            # from the request's replayable copy (MC_TOKENS), as `ask` does.
            try:
                await fill_from_copy(nc, ns, out)
            except Exception as exc:
                err.print(f"[yellow]tokens {out.missing()} not read back: {exc}[/yellow]")
        if got and not raw:
            _print_text(text.release() + text.rest())
            if out.finish_reason is not None:
                error = f" ({out.error})" if out.error else ""
                console.print(f"\n[dim]-- {out.finish_reason}{error}[/dim]")
    finally:
        await nc.close()
    if not got:
        err.print(f"[yellow]no reply within {wait_s:.0f}s[/yellow]")
        raise typer.Exit(1)


async def _follow(
    replies: AsyncIterator[dict[str, Any]], out: Outcome, text: InOrderText, raw: bool
) -> bool:
    """Print the replies as they come (the answer in token order: prefill's token 0 and
    decode's may cross); whether any came."""
    got = False
    async for body in replies:
        got = True
        out.take(body)
        if raw:
            console.print_json(json.dumps(body))
        elif "index" not in body:
            _print_decision(body)
        else:
            _print_text(text.release())
    return got


def _print_text(piece: str) -> None:
    if piece:
        console.print(piece, end="", markup=False, highlight=False)


def _print_decision(body: dict[str, object]) -> None:
    kind = str(body.get("type", "?")).removeprefix("request.")
    rid = body.get("request_id")
    if kind == "rejected":
        console.print(f"[red]{rid} rejected[/red]: {body.get('reason')} {body.get('detail', '')}")
    else:
        extras = {
            k: v
            for k, v in body.items()
            if k in ("policy", "prefill_instance", "decode_instance", "cached_prefix_tokens")
        }
        console.print(f"[green]{rid} {kind}[/green] {extras}")


# --- db ---------------------------------------------------------------------------------------


@db_app.command("upgrade")
def db_upgrade(revision: str = "head") -> None:
    """Apply migrations."""
    from mooncake.db.engine import upgrade

    upgrade(_require_db(settings_or_exit()), revision)
    console.print(f"database at {revision}")


@db_app.command("check")
def db_check() -> None:
    """Fail if the models and migrations have drifted (alembic check)."""
    from alembic.util.exc import CommandError

    from mooncake.db.engine import check

    try:
        check(_require_db(settings_or_exit()))
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

    url = _require_db(settings_or_exit())

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


def main() -> None:  # pragma: no cover - console entry point
    logging.basicConfig(level=logging.WARNING)
    app()


if __name__ == "__main__":
    app()

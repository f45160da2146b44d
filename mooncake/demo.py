"""`make demo`: the whole system on the embedded default, real prompts answered by SmolLM2
through disaggregated prefill and decode, a slice of the Mooncake conversation trace replayed,
the record shown, and a clean shutdown.

1. `mooncake up`'s stack: NATS and Postgres (embedded when none runs), the recorder, the store
   master, the Conductor, 2 prefill and 2 decode workers (each pooling its DRAM into the store).
2. Three chat prompts, answers printed as they come back, with TTFT and where they ran.
3. A malformed request, rejected at ingress with a reason.
4. The first requests of the conversation trace (bundled in `mooncake/data`) replayed: their
   shared hash ids become shared token prefixes, so later requests reuse cached KV blocks.
5. The record: every request in exactly one terminal state, projections rebuilt identically.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS
from rich.console import Console
from rich.table import Table
from sqlalchemy import text

from mooncake import events as ev
from mooncake.bus.connection import connect
from mooncake.client import Outcome, ask, new_request_id
from mooncake.config import Settings
from mooncake.db import rebuild as rb
from mooncake.db.engine import async_engine
from mooncake.replay_live import LiveReplayOptions, run_live_replay
from mooncake.stack import Stack, status_table

PROMPTS = (
    "What is the capital of France?",
    "Explain in one sentence why caching helps a web server.",
    "Write a haiku about the moon.",
)
TRACE_SLICE = Path(__file__).parent / "data" / "conversation_head.jsonl"
# KV blocks of a CPU-sized demo (the traces' 512-token blocks scaled to this many tokens).
DEMO_BLOCK_TOKENS = 16
TERMINAL = ("completed", "failed", "cancelled", "rejected")


def demo_settings(settings: Settings) -> Settings:
    if "block_tokens" in settings.model_fields_set:
        return settings
    return settings.model_copy(update={"block_tokens": DEMO_BLOCK_TOKENS})


def run_demo(settings: Settings, console: Console, *, requests: int) -> bool:
    settings = demo_settings(settings)
    stack = Stack(settings)
    try:
        with console.status("starting broker, database and workers"):
            stack.start_infrastructure()
            stack.start_workers()
        console.print(status_table(stack, "mooncake up"))
        live = settings.model_copy(
            update={"nats_url": stack.nats_url, "database_url": stack.database_url}
        )
        return asyncio.run(_flow(live, console, requests))
    finally:
        with console.status("shutting down"):
            stack.stop()
        console.print("stopped cleanly")


async def _flow(settings: Settings, console: Console, n: int) -> bool:
    ns = ev.Namespace(settings.namespace)
    nc = await connect(settings, "demo")
    assert settings.database_url
    engine = async_engine(settings.database_url)
    try:
        with console.status("waiting for the model to load in the prefill and decode workers"):
            ready = await _wait_ready(nc, ns, 600)
        if not ready:
            console.print(
                "[red]the pipeline did not answer within 600 s (see .mooncake/logs)[/red]"
            )
            return False
        ok = True
        for prompt in PROMPTS:
            out = await ask(nc, prompt, ns=ns, params=ev.SamplingParams(max_tokens=48))
            ok &= out.finished
            _print_answer(console, prompt, out)
        bad_id = new_request_id()
        reason = await _submit_bad(nc, ns, bad_id)
        console.print(f"[yellow]rejected[/yellow] malformed request {bad_id}: {reason}")
        console.print(f"replaying the first {n} requests of the conversation trace ...")
        summary = await run_live_replay(
            settings,
            LiveReplayOptions(
                TRACE_SLICE, speed=50.0, limit=n, tokens_per_block=settings.block_tokens,
                max_output_tokens=16, timeout_s=600,
            ),
        )  # fmt: skip
        _print_summary(console, summary)
        ok &= summary["completed"] + summary["rejected"] == summary["requests"]
        ok &= await _wait_recorded(engine, console)
        diffs = await rb.verify(engine)
        console.print(
            "[green]projections rebuilt from the events log match the live ones[/green]"
            if not diffs
            else f"[red]{len(diffs)} differences between live and rebuilt projections[/red]"
        )
        await _show_record(engine, console)
        return ok and not diffs
    finally:
        await engine.dispose()
        await nc.close()


async def _wait_ready(nc: NATS, ns: ev.Namespace, within_s: float) -> bool:
    """Until a tiny request makes it through admission, prefill and decode."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        out = await ask(
            nc, token_ids=[1, 2, 3], ns=ns, params=ev.SamplingParams(max_tokens=2), timeout_s=30
        )
        if out.finished:
            return True
        await asyncio.sleep(1.0)
    return False


def _print_answer(console: Console, prompt: str, out: Outcome) -> None:
    where = ""
    if out.decision is not None:
        d = out.decision
        where = f"prefill {d.get('prefill_instance')} -> decode {d.get('decode_instance')}"
    ttft = f"{out.ttft_s:.2f}s" if out.ttft_s is not None else "-"
    console.print(f"[bold]> {prompt}[/bold]")
    console.print(f"  {out.text.strip() or '(no text: ' + str(out.finish_reason) + ')'}")
    console.print(
        f"  [dim]{len(out.tokens)} tokens, TTFT {ttft}, {where}, {out.finish_reason}[/dim]"
    )


def _print_summary(console: Console, summary: dict[str, Any]) -> None:
    table = Table(title="trace replay")
    table.add_column("")
    table.add_column("value", justify="right")
    for key in ("requests", "admitted", "rejected", "completed", "failed", "unfinished"):
        table.add_row(key, str(summary[key]))
    for key in ("ttft_s", "tbt_s"):
        p = summary[key]
        table.add_row(key + " p50/p90/p99", f"{p['p50']} / {p['p90']} / {p['p99']}")
    hit = summary["hit_rate"]
    table.add_row("cache hit rate local / remote", f"{hit['local']:.1%} / {hit['remote']:.1%}")
    table.add_row("goodput (req/s)", str(summary["goodput_req_s"]))
    console.print(table)


async def _submit_bad(nc: NATS, ns: ev.Namespace, request_id: str) -> str:
    """A request with a negative max_tokens: rejected at ingress with a reason."""
    rejected_sub = await nc.subscribe(ns.of(ev.RequestRejected))
    body = json.dumps(
        {
            "type": "request.submitted",
            "request_id": request_id,
            "prompt": "hi",
            "params": {"max_tokens": -5},
        }
    ).encode()
    await nc.jetstream().publish(ns.of(ev.RequestSubmitted), body)
    deadline = time.monotonic() + 15
    try:
        while (left := deadline - time.monotonic()) > 0:
            msg = await rejected_sub.next_msg(timeout=left)
            parsed = ev.parse_event(msg.data)
            if isinstance(parsed, ev.RequestRejected) and parsed.request_id == request_id:
                return f"{parsed.reason.value}: {parsed.detail[:120]}"
    except TimeoutError:
        pass
    finally:
        await rejected_sub.unsubscribe()
    return "(no rejection seen)"


async def _wait_recorded(engine: Any, console: Console) -> bool:
    """Every request the record knows reaches a terminal status."""
    started = time.perf_counter()
    while time.perf_counter() - started < 60:
        async with engine.connect() as conn:
            open_ = (
                await conn.execute(
                    text("SELECT count(*) FROM requests WHERE NOT (status = ANY(:done))"),
                    {"done": list(TERMINAL)},
                )
            ).scalar_one()
        if open_ == 0:
            console.print(
                f"every request recorded in a terminal state after "
                f"{time.perf_counter() - started:.1f}s"
            )
            return True
        await asyncio.sleep(0.5)
    console.print(f"[red]{open_} requests not in a terminal state after 60s[/red]")
    return False


async def _show_record(engine: Any, console: Console) -> None:
    async with engine.connect() as conn:
        by_status = (
            await conn.execute(text("SELECT status, count(*) FROM requests GROUP BY 1 ORDER BY 1"))
        ).all()
        events = (await conn.execute(text("SELECT count(*) FROM events"))).scalar_one()
        dead = (await conn.execute(text("SELECT count(*) FROM dead_letters"))).scalar_one()
        kv = (await conn.execute(text("SELECT count(*) FROM kv_objects"))).scalar_one()
        instances = (
            await conn.execute(text("SELECT instance_id, role, status FROM instances ORDER BY 1"))
        ).all()
    table = Table(title=f"the record: {events} events, {dead} dead letters, {kv} KV objects")
    table.add_column("requests by status")
    table.add_column("count", justify="right")
    for status, count in by_status:
        table.add_row(status, str(count))
    console.print(table)
    console.print("instances: " + ", ".join(f"{i} ({r}, {s})" for i, r, s in instances))

"""`make demo`: the system on the embedded default, requests through it, the record shown.

At this stage of the project the pipeline ends at admission (prefill and decode workers
come with the engine and pipeline issues), so the demo shows what exists for real:
submissions admitted by the Conductor, a malformed one rejected with a reason, a burst
recorded exactly once in Postgres, and the projections rebuilt from the log identically.
"""

from __future__ import annotations

import asyncio
import json
import time

import nats
from nats.aio.client import Client as NATS
from rich.console import Console
from rich.table import Table
from sqlalchemy import text

from mooncake import events as ev
from mooncake.bus.publish import Publisher
from mooncake.client import new_request_id, submit
from mooncake.config import Settings
from mooncake.db import rebuild as rb
from mooncake.db.engine import async_engine
from mooncake.stack import Stack

PROMPTS = (
    "What is the capital of France?",
    "Explain KV cache reuse in one sentence.",
    "Write a haiku about the moon.",
)
ADMITTED = frozenset({"request.admitted", "request.rejected"})


def run_demo(settings: Settings, console: Console, *, requests: int) -> bool:
    stack = Stack(settings)
    try:
        with console.status("starting broker, database and workers"):
            stack.start_infrastructure()
            stack.start_workers(("recorder", "conductor"))
        table = Table(title="mooncake up")
        for col in ("component", "address", "state"):
            table.add_column(col)
        for row in stack.status_rows():
            table.add_row(*row)
        console.print(table)
        return asyncio.run(_flow(stack, console, requests, ev.Namespace(settings.namespace)))
    finally:
        with console.status("shutting down"):
            stack.stop()
        console.print("stopped cleanly")


async def _flow(stack: Stack, console: Console, n: int, ns: ev.Namespace) -> bool:
    nc = await nats.connect(stack.nats_url)
    engine = async_engine(stack.database_url)
    try:
        for prompt in PROMPTS:
            async for body in submit(nc, prompt, ns=ns, timeout_s=30, until=ADMITTED):
                console.print(f"[green]{body['type']}[/green] {body['request_id']}: {prompt!r}")
        bad_id = new_request_id()
        async for body in _submit_bad(nc, ns, bad_id):
            console.print(f"[yellow]{body['type']}[/yellow] {bad_id}: {body.get('detail')}")
        ids = await _burst(nc, ns, n, console)
        ok = await _wait_recorded(engine, ids, console)
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


async def _submit_bad(nc: NATS, ns: ev.Namespace, request_id: str):  # type: ignore[no-untyped-def]
    """A request with a negative max_tokens: rejected at ingress with a reason."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    body = json.dumps(
        {
            "type": "request.submitted",
            "request_id": request_id,
            "prompt": "hi",
            "params": {"max_tokens": -5},
            "reply_to": inbox,
        }
    ).encode()
    rejected_sub = await nc.subscribe(ns.of(ev.RequestRejected))
    await nc.jetstream().publish(ns.of(ev.RequestSubmitted), body)
    deadline = time.monotonic() + 15
    try:
        while time.monotonic() < deadline:
            msg = await rejected_sub.next_msg(timeout=deadline - time.monotonic())
            parsed = ev.parse_event(msg.data)
            if isinstance(parsed, ev.RequestRejected) and parsed.request_id == request_id:
                yield parsed.model_dump(mode="json")
                return
    finally:
        await sub.unsubscribe()
        await rejected_sub.unsubscribe()


async def _burst(nc: NATS, ns: ev.Namespace, n: int, console: Console) -> list[str]:
    publisher = Publisher(nc, nc.jetstream(), ns)
    batch = [
        ev.RequestSubmitted(request_id=new_request_id(), token_ids=[1, 2, 3, i % 1000])
        for i in range(n)
    ]
    started = time.perf_counter()
    await publisher.publish_many(batch)
    console.print(f"published {n} requests in {time.perf_counter() - started:.2f}s")
    return [e.request_id for e in batch]


async def _wait_recorded(engine, ids: list[str], console: Console) -> bool:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    while time.perf_counter() - started < 60:
        async with engine.connect() as conn:
            done = (
                await conn.execute(
                    text(
                        "SELECT count(*) FROM requests WHERE request_id = ANY(:ids) "
                        "AND status = 'admitted'"
                    ),
                    {"ids": ids},
                )
            ).scalar_one()
        if done == len(ids):
            console.print(
                f"all {len(ids)} admitted and recorded in Postgres after "
                f"{time.perf_counter() - started:.2f}s"
            )
            return True
        await asyncio.sleep(0.2)
    console.print(f"[red]only {done} of {len(ids)} recorded after 60s[/red]")
    return False


async def _show_record(engine, console: Console) -> None:  # type: ignore[no-untyped-def]
    async with engine.connect() as conn:
        by_status = (
            await conn.execute(text("SELECT status, count(*) FROM requests GROUP BY 1 ORDER BY 1"))
        ).all()
        events = (await conn.execute(text("SELECT count(*) FROM events"))).scalar_one()
        dead = (await conn.execute(text("SELECT count(*) FROM dead_letters"))).scalar_one()
        instances = (
            await conn.execute(text("SELECT instance_id, role, status FROM instances ORDER BY 1"))
        ).all()
    table = Table(title=f"the record: {events} events, {dead} dead letters")
    table.add_column("requests by status")
    table.add_column("count", justify="right")
    for status, count in by_status:
        table.add_row(status, str(count))
    console.print(table)
    console.print("instances: " + ", ".join(f"{i} ({r}, {s})" for i, r, s in instances))

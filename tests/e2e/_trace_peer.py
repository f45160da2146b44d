"""The second process of test_trace_propagation: consume one `request.submitted` with a real
`PullConsumer` + `per_message` handler, then write every span it finished as JSON and exit.

Usage: python _trace_peer.py --nats-url URL --namespace NS --out FILE [--timeout S]
Exit codes: 0 handled one message; 3 nothing arrived within the timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from mooncake import events as ev
from mooncake.bus.connection import connect, ensure_streams
from mooncake.bus.consume import ACK, ConsumerSpec, Delivery, Outcome, PullConsumer, per_message
from mooncake.config import Settings
from mooncake.telemetry import setup_tracing, tracer

CONSUMER = ConsumerSpec("MC_REQ", "trace_peer", ev.RequestSubmitted.SUBJECT)
HANDLER_NAME = "trace-peer"
INNER_SPAN = "peer work"


def _hex(value: int, width: int) -> str:
    return format(value, f"0{width}x")


def span_record(span: object) -> dict[str, object]:
    ctx = span.get_span_context()  # type: ignore[attr-defined]
    parent = span.parent  # type: ignore[attr-defined]
    return {
        "name": span.name,  # type: ignore[attr-defined]
        "kind": span.kind.name,  # type: ignore[attr-defined]
        "trace_id": _hex(ctx.trace_id, 32),
        "span_id": _hex(ctx.span_id, 16),
        "parent_span_id": _hex(parent.span_id, 16) if parent is not None else None,
        "parent_is_remote": bool(parent.is_remote) if parent is not None else None,
        "attributes": dict(span.attributes or {}),  # type: ignore[attr-defined]
    }


async def consume_one(args: argparse.Namespace) -> dict[str, object] | None:
    """Handle one message; the report to write, or None when nothing arrived in time."""
    settings = Settings(nats_url=args.nats_url, namespace=args.namespace, otlp_endpoint=None)
    exporter = InMemorySpanExporter()
    setup_tracing(settings, "trace-peer", exporter=exporter)
    ns = ev.Namespace(settings.namespace)
    stop = asyncio.Event()
    seen: dict[str, object] = {}

    async def handle(d: Delivery) -> Outcome:
        with tracer().start_as_current_span(INNER_SPAN, kind=SpanKind.INTERNAL):
            event = ev.parse_event(d.data, subject=ns.canonical(d.subject))
            seen["request_id"] = getattr(event, "request_id", None)
            seen["event_traceparent"] = getattr(event, "traceparent", None)
            seen["header_traceparent"] = d.headers.get("traceparent")
        stop.set()
        return ACK

    nc = await connect(settings, "trace-peer")
    try:
        js = nc.jetstream()
        await ensure_streams(js, settings)
        consumer = PullConsumer(nc, js, CONSUMER, settings.bus, ns)
        run = asyncio.create_task(consumer.run(per_message(handle, HANDLER_NAME), stop))
        try:
            await asyncio.wait_for(asyncio.shield(run), args.timeout)
        except TimeoutError:
            stop.set()
            await run
            return None
    finally:
        await nc.drain()
    return {"seen": seen, "spans": [span_record(s) for s in exporter.get_finished_spans()]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nats-url", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args(argv)
    report = asyncio.run(consume_one(args))
    if report is None:
        print(f"no message within {args.timeout}s", file=sys.stderr)
        return 3
    Path(args.out).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

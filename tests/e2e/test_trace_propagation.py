"""A trace crosses a process boundary through NATS headers.

This process opens a span and publishes a `request.submitted` with the real `Publisher`; a
second OS process (`_trace_peer.py`) consumes it with the real `PullConsumer` +
`per_message` and writes the spans it finished to a file. Both sides must be one trace, and
the consumer span's parent must be the producer's publish span.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from pathlib import Path

import pytest
from opentelemetry import context as otel_context
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from mooncake import events as ev
from mooncake.bus.connection import connect, ensure_streams
from mooncake.bus.publish import Publisher
from mooncake.config import Settings
from mooncake.services import EmbeddedNats
from mooncake.telemetry import setup_tracing, tracer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

PEER = Path(__file__).with_name("_trace_peer.py")
PEER_HANDLER = "trace-peer"  # the name `_trace_peer.py` gives `per_message`
PEER_INNER_SPAN = "peer work"


def _hex(value: int, width: int) -> str:
    return format(value, f"0{width}x")


def _child_env() -> dict[str, str]:
    """The peer gets its settings from its arguments only (no stray MOONCAKE_* exporter)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("MOONCAKE_")}


async def test_trace_crosses_processes(tmp_path: Path) -> None:
    nats = EmbeddedNats.create(tmp_path).start()
    peer: asyncio.subprocess.Process | None = None
    try:
        settings = Settings(
            nats_url=nats.url, namespace="tr" + uuid.uuid4().hex[:10], otlp_endpoint=None
        )
        exporter = InMemorySpanExporter()
        setup_tracing(settings, "client", exporter=exporter)

        nc = await connect(settings, "trace-client")
        try:
            js = nc.jetstream()
            await ensure_streams(js, settings)
            publisher = Publisher(nc, js, ev.Namespace(settings.namespace))

            out = tmp_path / "peer-spans.json"
            peer = await asyncio.create_subprocess_exec(
                sys.executable,
                str(PEER),
                "--nats-url",
                nats.url,
                "--namespace",
                settings.namespace,
                "--out",
                str(out),
                "--timeout",
                "60",
                cwd=tmp_path,  # no .env / runtime.env of the checkout
                env=_child_env(),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )

            request = ev.RequestSubmitted(request_id="trace-" + uuid.uuid4().hex, prompt="hello")
            # A fresh root, whatever context the test runner's loop carries.
            with tracer().start_as_current_span(
                "client submit", context=otel_context.Context()
            ) as root:
                await publisher.publish(request)
            root_ctx = root.get_span_context()
        finally:
            await nc.drain()

        output, _ = await asyncio.wait_for(peer.communicate(), timeout=90)
        log = output.decode(errors="replace")
        assert peer.returncode == 0, f"peer exited {peer.returncode}:\n{log}"
        report = json.loads(out.read_text())
    finally:
        if peer is not None and peer.returncode is None:
            peer.kill()
            await peer.wait()
        nats.stop()

    trace_id = _hex(root_ctx.trace_id, 32)
    root_id = _hex(root_ctx.span_id, 16)

    # Producer side: root -> publish span (PRODUCER), all in this trace.
    client = [s for s in exporter.get_finished_spans() if s.context.trace_id == root_ctx.trace_id]
    publish_spans = [s for s in client if s.name == f"publish {request.type}"]
    assert len(publish_spans) == 1, [s.name for s in client]
    publish = publish_spans[0]
    assert publish.kind == SpanKind.PRODUCER
    assert publish.parent is not None and _hex(publish.parent.span_id, 16) == root_id
    publish_id = _hex(publish.context.span_id, 16)

    # The wire carries the publish span's context, in the headers and on the event itself.
    expected_tp = f"00-{trace_id}-{publish_id}-{publish.context.trace_flags:02x}"
    assert report["seen"]["request_id"] == request.request_id
    assert report["seen"]["header_traceparent"] == expected_tp
    assert report["seen"]["event_traceparent"] == expected_tp

    # Consumer side: one trace id across both processes ...
    spans = report["spans"]
    assert spans, "the peer finished no spans"
    assert {s["trace_id"] for s in spans} == {trace_id}

    # ... the consumer span is a child of the producer's publish span (a remote parent) ...
    subject = ev.Namespace(settings.namespace).of(ev.RequestSubmitted)
    consumer = [s for s in spans if s["name"] == f"{PEER_HANDLER} {subject}"]
    assert len(consumer) == 1, [s["name"] for s in spans]
    consumer_span = consumer[0]
    assert consumer_span["kind"] == "CONSUMER"
    assert consumer_span["parent_span_id"] == publish_id
    assert consumer_span["parent_is_remote"] is True
    assert consumer_span["span_id"] not in (publish_id, root_id)

    # ... and work inside the handler hangs under the consumer span, locally.
    inner = [s for s in spans if s["name"] == PEER_INNER_SPAN]
    assert len(inner) == 1
    assert inner[0]["parent_span_id"] == consumer_span["span_id"]
    assert inner[0]["parent_is_remote"] is False

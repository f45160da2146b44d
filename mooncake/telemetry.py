"""Tracing and metrics setup, and trace-context propagation through NATS headers.

Spans are always created (cheap, and tests read them from an in-memory exporter); they are
exported over OTLP/HTTP only when `Settings.otlp_endpoint` is set. Each worker process
serves Prometheus `/metrics` on `Settings.metrics_port` (0 = a free port, -1 = off).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, MutableMapping

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter

from mooncake.config import Settings

log = logging.getLogger(__name__)
TRACER_NAME = "mooncake"


def setup_tracing(
    settings: Settings, role: str, *, exporter: SpanExporter | None = None
) -> TracerProvider:
    """Install the process-wide tracer provider for one worker role.

    `exporter` (tests) is attached with a simple, synchronous processor so spans are
    visible as soon as they end; the OTLP exporter is batched.

    OpenTelemetry installs the global provider once per process and ignores (with only a
    warning) any later one, so a second call (tests, in-process workers) attaches its
    exporter to the provider already in use and returns that one.
    """
    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):
        if exporter is not None:
            current.add_span_processor(SimpleSpanProcessor(exporter))
        return current
    resource = Resource.create(
        {"service.name": f"{settings.service_name}-{role}", "mooncake.role": role}
    )
    provider = TracerProvider(resource=resource)
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    if settings.otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        endpoint = settings.otlp_endpoint.rstrip("/") + "/v1/traces"
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)
    return provider


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def inject_headers(headers: MutableMapping[str, str], context: Context | None = None) -> None:
    """Write the W3C trace context of the current (or given) span into message headers."""
    propagate.inject(headers, context=context)


def extract_context(headers: Mapping[str, str] | None) -> Context:
    return propagate.extract(dict(headers or {}))


def current_traceparent() -> str | None:
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier.get("traceparent")


def start_metrics_server(port: int, host: str = "127.0.0.1") -> int | None:
    """Serve Prometheus metrics for this process; returns the bound port (None when off)."""
    if port < 0:
        return None
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, addr=host)
    bound = int(server.server_address[1])
    log.info("metrics on :%d/metrics", bound)
    return bound

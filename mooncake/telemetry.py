"""Tracing and metrics setup, and trace-context propagation through NATS headers.

Every hop opens a span and propagates its context, always. Whether spans are *recorded*
is sampling: with somewhere to send them (OTLP endpoint, or a test's exporter) every trace
is sampled (or `Settings.trace_sample_ratio` of them); with nowhere, none are, so an
untraced deployment does not pay for building spans it would throw away. A sampled parent
(a traced client) makes its children sampled too (parent-based sampling). Each worker
process serves Prometheus `/metrics` on `Settings.metrics_port` (0 = free port, -1 = off).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)

from mooncake.config import Settings

log = logging.getLogger(__name__)
TRACER_NAME = "mooncake"


class _RootSampler(Sampler):
    """Samples new traces at `ratio` once there is somewhere to export them, else none."""

    def __init__(self, ratio: float, enabled: bool) -> None:
        self.ratio = ratio
        self.enabled = enabled
        self._on = TraceIdRatioBased(ratio)

    def should_sample(self, *args: object, **kwargs: object) -> SamplingResult:
        target = self._on if self.enabled else ALWAYS_OFF
        return target.should_sample(*args, **kwargs)  # type: ignore[arg-type]

    def get_description(self) -> str:
        return f"MooncakeRoot(ratio={self.ratio}, enabled={self.enabled})"


# The root sampler of the provider this module installed (one per process).
_installed_root: _RootSampler | None = None


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
    global _installed_root
    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):
        if exporter is not None:
            current.add_span_processor(SimpleSpanProcessor(exporter))
            if _installed_root is not None:
                _installed_root.enabled = True
        return current
    resource = Resource.create(
        {"service.name": f"{settings.service_name}-{role}", "mooncake.role": role}
    )
    exporting = exporter is not None or bool(settings.otlp_endpoint) or bool(settings.trace_dir)
    _installed_root = _RootSampler(settings.trace_sample_ratio, exporting)
    provider = TracerProvider(resource=resource, sampler=ParentBased(_installed_root))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    if settings.trace_dir is not None:
        provider.add_span_processor(SimpleSpanProcessor(_file_exporter(settings.trace_dir, role)))
    if settings.otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        endpoint = settings.otlp_endpoint.rstrip("/") + "/v1/traces"
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)
    return provider


def _file_exporter(directory: Path, role: str) -> SpanExporter:
    """Spans as JSON lines in a file of this process's own (no interleaving writers)."""
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    directory.mkdir(parents=True, exist_ok=True)
    out = open(directory / f"{role}-{os.getpid()}.jsonl", "a", buffering=1)
    return ConsoleSpanExporter(out=out, formatter=lambda span: span.to_json(indent=None) + "\n")


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def inject_headers(headers: MutableMapping[str, str], context: Context | None = None) -> None:
    """Write the W3C trace context of the current (or given) span into message headers."""
    if context is None and not trace.get_current_span().get_span_context().is_valid:
        return  # outside any trace (e.g. the store master's journal): nothing to carry
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

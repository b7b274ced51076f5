"""One OpenTelemetry tracer per service.

Spans go to OTLP/HTTP when `OTEL_EXPORTER_OTLP_ENDPOINT` is set; otherwise each finished span is
appended as one JSON line to `<run_dir>/spans.jsonl` (shared by every service of a run: lines are
written with O_APPEND in one write each, so concurrent writers do not interleave).
W3C trace context travels in NATS message headers (`traceparent`, `tracestate`).
"""

from __future__ import annotations

import functools
import json
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Status, StatusCode

_provider: TracerProvider | None = None
_lock = threading.Lock()


class JsonlSpanExporter(SpanExporter):
    """Appends finished spans to a JSON-lines file (one compact object per span)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = []
        for span in spans:
            ctx = span.get_span_context()
            parent = span.parent
            lines.append(
                json.dumps(
                    {
                        "name": span.name,
                        "service": span.resource.attributes.get("service.name", ""),
                        "trace_id": format(ctx.trace_id, "032x"),
                        "span_id": format(ctx.span_id, "016x"),
                        "parent_span_id": format(parent.span_id, "016x") if parent else None,
                        "start_unix_ns": span.start_time,
                        "end_unix_ns": span.end_time,
                        "status": span.status.status_code.name,
                        "status_description": span.status.description or "",
                        "attributes": {k: _plain(v) for k, v in (span.attributes or {}).items()},
                        "events": [
                            {"name": e.name, "attributes": {k: _plain(v) for k, v in (e.attributes or {}).items()}}
                            for e in span.events
                        ],
                    },
                    separators=(",", ":"),
                )
            )
        if lines:
            data = ("\n".join(lines) + "\n").encode()
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


def _plain(value: object) -> object:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return list(value) if isinstance(value, (list, tuple)) else str(value)


def setup_tracing(service_name: str, run_dir: Path, instance: str = "") -> TracerProvider:
    """Install the process-wide tracer provider (idempotent). Returns it so that the caller can flush on exit."""
    global _provider
    with _lock:
        if _provider is not None:
            return _provider
        attributes = {"service.name": service_name}
        if instance:
            attributes["service.instance.id"] = instance
        provider = TracerProvider(resource=Resource.create(attributes))
        if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter: SpanExporter = OTLPSpanExporter()
        else:
            exporter = JsonlSpanExporter(Path(run_dir) / "spans.jsonl")
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=200))
        trace.set_tracer_provider(provider)
        _provider = provider
        return provider


def shutdown_tracing() -> None:
    global _provider
    with _lock:
        if _provider is not None:
            _provider.force_flush(timeout_millis=2000)
            _provider.shutdown()


@functools.cache
def tracer(name: str = "nitsum") -> trace.Tracer:
    """One tracer per name (`trace.get_tracer` makes a new one at each call: ~2 % of a gateway's CPU when asked
    per request). One asked for before `setup_tracing` is the API's proxy, which follows the provider once set."""
    return trace.get_tracer(name)


def inject_headers(headers: dict[str, str] | None = None) -> dict[str, str]:
    """The current trace context as W3C headers, ready for a NATS message."""
    carrier: dict[str, str] = dict(headers or {})
    propagate.inject(carrier)
    return carrier


def extract_context(headers: Mapping[str, str] | None) -> otel_context.Context:
    return propagate.extract(dict(headers or {}))


def mark_error(span: trace.Span, reason: str) -> None:
    span.set_status(Status(StatusCode.ERROR, reason))
    span.set_attribute("nitsum.error", reason)

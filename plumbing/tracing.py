"""One OpenTelemetry trace per request, across the queue.

Off unless an OTLP endpoint is configured by the standard variables (`OTEL_EXPORTER_OTLP_ENDPOINT` or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, with `OTEL_EXPORTER_OTLP_PROTOCOL`, `OTEL_TRACES_SAMPLER` and the
rest read by the SDK) or `SLUICE_TRACE_TIMELINE` asks for the dashboard's timeline; `OTEL_SDK_DISABLED`
turns both off. When off, `ENABLED` is false and every helper returns at once, so callers pay one flag test.

The context travels as a W3C `traceparent`: in Kafka record headers (OpenTelemetry's messaging
convention), in the request message a worker reads (`InferenceRequest.trace`), and back on a stream's first
and final chunks. Hops a service only learns about afterwards (time in Kafka, in a hold, in a worker's inbox)
are recorded as spans with explicit start and end times, so the spans of one request cover it end to end.

The timeline recorder keeps each request's spans in Redis (`Names.trace`) for the dashboard, which needs no
tracing backend to show where a request's time went.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import structlog
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from queue_schemas.messages import TRACEPARENT_PATTERN, InferenceRequest
from queue_schemas.names import Names
from queue_schemas.settings import BusSettings

log = structlog.get_logger("sluice.tracing")

TRACEPARENT = "traceparent"
# A record or a client sending anything but a version-00 W3C trace context starts a new trace.
_TRACEPARENT = re.compile(TRACEPARENT_PATTERN)

# Span attributes an operator filters on (OpenTelemetry's names where it has one).
REQUEST_ID = "sluice.request_id"
TEAM = "sluice.team"
POOL = "sluice.pool"
MODEL = "gen_ai.request.model"
WORKER = "sluice.worker"
PRIORITY = "sluice.priority"
PROMPT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
CACHED_TOKENS = "sluice.cached_tokens"
OUTCOME = "sluice.outcome"
ROOT = "sluice.root"  # the span that covers a request end to end (the ingress's, or a batch line's)

TIMELINE_SPANS = 256  # spans kept per request (a request that moves many times keeps its latest)
SLOWEST_PER_MINUTE = 50  # the slowest requests kept of each minute, for the dashboard to pick from

_propagator = TraceContextTextMapPropagator()
_tracer: trace.Tracer | None = None
ENABLED = False


def request_attributes(request: InferenceRequest) -> dict[str, Any]:
    """The attributes every service's spans of a request carry, to filter on. Pure."""
    return {
        REQUEST_ID: request.request_id,
        TEAM: request.team,
        POOL: request.pool,
        MODEL: request.adapter or request.model,
        PRIORITY: request.priority.value,
        PROMPT_TOKENS: len(request.prompt_token_ids),
    }


def otlp_configured(env: Mapping[str, str]) -> bool:
    """Whether the standard variables name an OTLP endpoint for traces (and nothing turns them off)."""
    if env.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def wanted(settings: BusSettings, env: Mapping[str, str]) -> bool:
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return otlp_configured(env) or settings.trace_timeline


def configure(settings: BusSettings, service: str, env: Mapping[str, str] | None = None) -> bool:
    """Install the tracer provider of a service process, when tracing is wanted. Returns whether it is."""
    global _tracer, ENABLED
    env = os.environ if env is None else env
    if not wanted(settings, env):
        return False
    attributes = {} if env.get("OTEL_SERVICE_NAME") else {"service.name": f"sluice-{service}"}
    provider = TracerProvider(resource=Resource.create(attributes))
    if otlp_configured(env):
        provider.add_span_processor(BatchSpanProcessor(_otlp_exporter(env)))
    if settings.trace_timeline:
        exporter = TimelineExporter(settings, service)
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
    trace.set_tracer_provider(provider)
    _tracer = provider.get_tracer("sluice")
    ENABLED = True
    return True


def _otlp_exporter(env: Mapping[str, str]) -> SpanExporter:
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    if (protocol or "http/protobuf").strip() == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc
        except ImportError:
            raise SystemExit(
                "OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs opentelemetry-exporter-otlp-proto-grpc installed; "
                "or use http/protobuf"
            ) from None
        return Grpc()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def shutdown() -> None:
    """Flush what is buffered (a service calls this as it stops; the SDK also does at exit)."""
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.shutdown()


def ns(epoch_s: float) -> int:
    return int(epoch_s * 1e9)


def valid_traceparent(value: object) -> str | None:
    """`value` if it is a W3C traceparent this service can continue, else None."""
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if isinstance(value, str) and len(value) == 55 and _TRACEPARENT.match(value):
        return value
    return None


def parent(traceparent: str | None) -> Context | None:
    """The context a `traceparent` continues; None for a missing or invalid one. A `tracestate` from a
    client or a record is not carried: sluice reads none, and an invalid one costs a warning a request."""
    if not ENABLED or valid_traceparent(traceparent) is None:
        return None
    ctx = _propagator.extract({TRACEPARENT: str(traceparent)})
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def new_trace() -> Context:
    """The context of a span that starts a trace of its own, whatever span is current."""
    return Context()


def header_traceparent(headers: Sequence[tuple[str, bytes]] | None) -> str | None:
    """The traceparent of Kafka record headers (untrusted: checked, else None)."""
    for key, value in headers or ():
        if key == TRACEPARENT:
            return valid_traceparent(value)
    return None


def traceparent_of(span: Span | None) -> str | None:
    """The W3C traceparent naming `span` (what a child in another process continues)."""
    if span is None:
        return None
    sc = span.get_span_context()
    if not sc.is_valid:
        return None
    return f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}"


def current_headers() -> dict[str, str] | None:
    """The current span as W3C headers (for an engine that continues the trace), or None."""
    if not ENABLED:
        return None
    value = traceparent_of(trace.get_current_span())
    return None if value is None else {TRACEPARENT: value}


def kafka_headers(span: Span | None) -> list[tuple[str, bytes]]:
    value = traceparent_of(span)
    return [] if value is None else [(TRACEPARENT, value.encode())]


def start(
    name: str,
    parent_ctx: Context | None,
    start_s: float | None = None,
    attributes: Mapping[str, Any] | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
) -> Span | None:
    """A span to end later (None when tracing is off). `parent_ctx` None: the current context's span, or a
    new trace when there is none."""
    if _tracer is None:
        return None
    return _tracer.start_span(
        name,
        context=parent_ctx,
        kind=kind,
        attributes=_clean(attributes),
        start_time=None if start_s is None else ns(start_s),
    )


def end(span: Span | None, end_s: float | None = None, error: str | None = None) -> None:
    if span is None:
        return
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end(None if end_s is None else ns(end_s))


def record(
    name: str,
    parent_ctx: Context | None,
    start_s: float,
    end_s: float,
    attributes: Mapping[str, Any] | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
) -> Span | None:
    """A span of a hop already over, from `start_s` to `end_s` (epoch seconds)."""
    span = start(name, parent_ctx, start_s, attributes, kind)
    end(span, max(start_s, end_s))
    return span


def child_context(span: Span | None) -> Context | None:
    return None if span is None else trace.set_span_in_context(span)


def set_attributes(span: Span | None, attributes: Mapping[str, Any]) -> None:
    if span is not None:
        span.set_attributes(_clean(attributes))


@contextmanager
def current(span: Span | None) -> Iterator[None]:
    """Make `span` the current one (log lines carry its trace id) for the block."""
    if span is None:
        yield
        return
    token = otel_context.attach(trace.set_span_in_context(span))
    try:
        yield
    finally:
        otel_context.detach(token)


def _clean(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    """Attributes OpenTelemetry can carry: None dropped, other values as str/int/float/bool."""
    out: dict[str, Any] = {}
    for key, value in (attributes or {}).items():
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            continue
        out[key] = value if isinstance(value, str | int | float | bool) else str(value)
    return out


def trace_id_of(traceparent: str | None) -> str | None:
    """The trace id a traceparent names. Pure."""
    return traceparent[3:35] if traceparent is not None and len(traceparent) == 55 else None


def logging_for(traceparent: str | None) -> AbstractContextManager[Any]:
    """Within the block, log lines carry the trace id of `traceparent` (a request handled outside its
    spans: a held request tried, a worker's task)."""
    trace_id = trace_id_of(traceparent) if ENABLED else None
    if trace_id is None:
        return nullcontext()
    return structlog.contextvars.bound_contextvars(trace_id=trace_id)


def add_trace_id(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor: a log line written inside a traced request carries its trace id."""
    if ENABLED:
        sc = trace.get_current_span().get_span_context()
        if sc.is_valid:
            event.setdefault("trace_id", f"{sc.trace_id:032x}")
    return event


# The timeline recorder.


def timeline_entry(span: ReadableSpan, service: str) -> dict[str, Any] | None:
    """What the dashboard keeps of a span of a request: None for a span that names no request. Pure."""
    attrs = dict(span.attributes or {})
    request_id = attrs.get(REQUEST_ID)
    if not isinstance(request_id, str) or span.start_time is None or span.end_time is None:
        return None
    sc = span.get_span_context()
    parent_id = span.parent.span_id if span.parent is not None else None
    return {
        "request_id": request_id,
        "name": span.name,
        "service": service,
        "trace_id": f"{sc.trace_id:032x}" if sc else None,
        "span_id": f"{sc.span_id:016x}" if sc else None,
        "parent_id": None if parent_id is None else f"{parent_id:016x}",
        "start": span.start_time / 1e9,
        "end": span.end_time / 1e9,
        "error": span.status.description if span.status.status_code is StatusCode.ERROR else None,
        "attributes": {k: v for k, v in attrs.items() if k != REQUEST_ID},
    }


class TimelineExporter(SpanExporter):
    """Writes each request's spans to a Redis list (Names.trace, expiring) and its end-to-end span to the
    slowest requests of its minute (Names.slow_traces); runs in the span processor's thread, with a
    client of its own, connected at the first export (a service starts whether Redis is up or not)."""

    def __init__(self, settings: BusSettings, service: str) -> None:
        self._settings = settings
        self._redis: Any = None
        self._names: Names = settings.names
        self._ttl_s = settings.trace_timeline_ttl_s
        self._service = service

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        entries = [e for e in (timeline_entry(s, self._service) for s in spans) if e is not None]
        if not entries:
            return SpanExportResult.SUCCESS
        names = self._names
        try:
            if self._redis is None:
                from plumbing.clients import sync_redis_client

                self._redis = sync_redis_client(self._settings)
            pipe = self._redis.pipeline(transaction=False)
            lists, minutes = set(), set()
            for entry in entries:
                key = names.trace(entry["request_id"])
                lists.add(key)
                pipe.rpush(key, json.dumps(entry, separators=(",", ":")))
                if entry["attributes"].get(ROOT):
                    took = entry["end"] - entry["start"]
                    minute = names.slow_traces(int(entry["end"] // 60))
                    minutes.add(minute)
                    pipe.zadd(minute, {f"{entry['request_id']} {entry['end']:.3f}": took})
            for key in lists:  # once per request and export, not per span
                pipe.ltrim(key, -TIMELINE_SPANS, -1)
                pipe.expire(key, self._ttl_s)
            for key in minutes:
                pipe.zremrangebyrank(key, 0, -SLOWEST_PER_MINUTE - 1)
                pipe.expire(key, self._ttl_s)
            pipe.execute()
        except Exception as exc:  # the recorder must never take a service down
            log.warning("request timeline not recorded", error=str(exc) or type(exc).__name__)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        if self._redis is not None:
            self._redis.close()

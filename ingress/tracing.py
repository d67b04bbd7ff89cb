"""The ingress's part of a request's trace (plumbing.tracing): the server span of each generating route
(continuing a client's `traceparent`), admission up to the queue, the Kafka send, and the relay of the
answer. Nothing here runs when tracing is off."""

from __future__ import annotations

import time
from contextvars import ContextVar
from typing import Any

from opentelemetry.trace import Span, SpanKind
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from plumbing import tracing
from queue_schemas.messages import FinalChunk, InferenceRequest, StreamEvent

# The generating routes: each request through them is one trace.
TRACED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})

# When the current HTTP request arrived (epoch seconds), and its server span: admission starts there.
_arrived: ContextVar[float | None] = ContextVar("sluice_arrived", default=None)
_server_span: ContextVar[Span | None] = ContextVar("sluice_server_span", default=None)


class TraceMiddleware:
    """A server span around each generating request, the client's `traceparent` its parent if valid."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in TRACED_PATHS:
            await self.app(scope, receive, send)
            return
        traceparent = next((v for k, v in scope["headers"] if k == b"traceparent"), None)
        parent = tracing.parent(tracing.valid_traceparent(traceparent)) or tracing.new_trace()
        arrived = time.time()
        span = tracing.start(
            f"POST {scope['path']}",
            parent,
            arrived,
            {"http.request.method": "POST", "url.path": scope["path"], tracing.ROOT: True},
            SpanKind.SERVER,
        )
        status: dict[str, int] = {}

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        arrived_token, span_token = _arrived.set(arrived), _server_span.set(span)
        try:
            with tracing.current(span):
                await self.app(scope, receive, sending)
        finally:
            _arrived.reset(arrived_token)
            _server_span.reset(span_token)
            code = status.get("code", 500)
            tracing.set_attributes(span, {"http.response.status_code": code})
            tracing.end(span, error=f"HTTP {code}" if code >= 500 else None)


def before_send(request: InferenceRequest, topic: str) -> tuple[InferenceRequest, list[Any], Span | None]:
    """Admission ends here: its span (from the request's arrival) is recorded and the Kafka send's span
    starts. Returns the request carrying that span as its `traceparent`, the record headers, the span."""
    if not tracing.ENABLED:
        return request, [], None
    now = time.time()
    attributes = {**tracing.request_attributes(request), "sluice.tier": request.tier.value}
    server = _server_span.get()
    tracing.set_attributes(server, attributes)
    arrived = _arrived.get()
    if arrived is not None:
        tracing.record("admission", None, arrived, now, attributes)
    span = tracing.start(
        f"{topic} publish",
        None,
        now,
        {
            **attributes,
            "messaging.system": "kafka",
            "messaging.operation.type": "publish",
            "messaging.destination.name": topic,
        },
        SpanKind.PRODUCER,
    )
    traced = request.model_copy(update={"traceparent": tracing.traceparent_of(span)})
    return traced, tracing.kafka_headers(span), span


class Relay:
    """The relay span of one answer: from its first chunk at this ingress to its last event out."""

    __slots__ = ("_attributes", "_span")

    def __init__(self, request_id: str, pool: str) -> None:
        self._span: Span | None = None
        self._attributes = {tracing.REQUEST_ID: request_id, tracing.POOL: pool}

    def chunk(self) -> None:
        """A chunk arrived: the relay's span starts at the first, within a traced request (a stream read
        again later is no part of its request's trace)."""
        if tracing.ENABLED and self._span is None and _server_span.get() is not None:
            self._span = tracing.start("relay", None, time.time(), self._attributes)

    def done(self, outcome: str, final: StreamEvent | None) -> None:
        if self._span is None:
            return
        attributes: dict[str, Any] = {tracing.OUTCOME: outcome}
        if isinstance(final, FinalChunk):
            attributes[tracing.OUTPUT_TOKENS] = final.usage.completion_tokens
            attributes[tracing.CACHED_TOKENS] = final.usage.cached_tokens
            attributes[tracing.WORKER] = final.worker_id
            if final.traceparent is not None:
                attributes["sluice.worker_span"] = final.traceparent
        tracing.set_attributes(self._span, attributes)
        tracing.set_attributes(_server_span.get(), attributes)
        tracing.end(self._span, error=None if outcome in ("ok", "cancelled") else outcome)
        self._span = None

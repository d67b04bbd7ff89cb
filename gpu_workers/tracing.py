"""The worker's part of a request's trace (plumbing.tracing), continuing the placement's span: time in
the inbox (from the dispatcher's append, which the entry id dates, to the start here), then the request on
the engine: the prefill handoff when there is one, prefill to the first token, and decode to the final
chunk. Nothing here runs when tracing is off."""

from __future__ import annotations

import time
from typing import Any

from opentelemetry.trace import Span

from plumbing import tracing
from queue_schemas.messages import InferenceRequest
from queue_schemas.usage import Timing


def entry_time(entry_id: bytes) -> float | None:
    """When a Redis Stream entry was appended (its id's milliseconds), or None for an odd id. Pure."""
    head = entry_id.split(b"-", 1)[0]
    return int(head) / 1000 if head.isdigit() else None


class RequestSpans:
    """The spans of one request on this worker."""

    __slots__ = ("_attributes", "_began", "_kv_at", "span")

    def __init__(self, request: InferenceRequest, entry_id: bytes, worker_id: str, began: float) -> None:
        self.span: Span | None = None
        if not tracing.ENABLED:
            return
        self._attributes: dict[str, Any] = {
            **tracing.request_attributes(request),
            tracing.WORKER: worker_id,
        }
        self._began = began
        self._kv_at: float | None = None
        parent = tracing.parent(request.traceparent)
        appended = entry_time(entry_id)
        if appended is not None:
            tracing.record("inbox", parent, min(appended, began), began, self._attributes)
        attributes = dict(self._attributes)
        if request.resume is not None:
            attributes["sluice.delivered_tokens"] = request.resume.delivered_tokens
        self.span = tracing.start("generate", parent, began, attributes)

    @property
    def traceparent(self) -> str | None:
        return tracing.traceparent_of(self.span)

    def kv_loaded(self, now: float) -> None:
        if self.span is not None:
            self._kv_at = now

    def finish(self, timing: Timing, outcome: str, output_tokens: int, cached_tokens: int | None) -> None:
        span = self.span
        if span is None:
            return
        now = timing.ended if timing.ended is not None else time.time()
        ctx = tracing.child_context(span)
        prefill_from = self._began
        if self._kv_at is not None:
            tracing.record("handoff", ctx, self._began, self._kv_at, self._attributes)
            prefill_from = self._kv_at
        first = timing.first_token
        if first is not None:
            tracing.record("prefill", ctx, prefill_from, first, self._attributes)
            tracing.record("decode", ctx, first, now, self._attributes)
        attributes: dict[str, Any] = {tracing.OUTCOME: outcome, tracing.OUTPUT_TOKENS: output_tokens}
        if cached_tokens is not None:
            attributes[tracing.CACHED_TOKENS] = cached_tokens
        tracing.set_attributes(span, attributes)
        tracing.end(span, now, error=None if outcome in ("ok", "moved", "left", "cancelled") else outcome)
        self.span = None

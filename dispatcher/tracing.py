"""The dispatcher's part of a request's trace (plumbing.tracing), recorded when the request is placed: its
time in Kafka (from the record's timestamp to its receipt here), in the hold and why, a move off a lost
worker, and the placement itself, whose span the worker continues. Nothing here runs when tracing is off."""

from __future__ import annotations

import time
from typing import Any

from opentelemetry.trace import Span, SpanKind

from dispatcher.hold import Held
from dispatcher.placement import Decision
from plumbing import tracing
from queue_schemas.messages import InferenceRequest


def received(
    request: InferenceRequest, headers: Any, timestamp_ms: int | None, now: float
) -> tuple[InferenceRequest, float | None]:
    """A request from a Kafka record: its trace continued from the record's `traceparent` header (the
    messaging convention) when it has one, and when the record was produced (None: unknown)."""
    if not tracing.ENABLED:
        return request, None
    traceparent = tracing.header_traceparent(headers)
    produced = timestamp_ms / 1000 if timestamp_ms and 0 < timestamp_ms / 1000 <= now else None
    if traceparent is None and request.traceparent is None:
        # A record from a producer that traces nothing (a batch submitter): its trace starts here, with
        # its time in Kafka as the root span.
        span = tracing.record(
            "receive",
            tracing.new_trace(),
            produced or now,
            now,
            {**tracing.request_attributes(request), **_consumer},
            SpanKind.CONSUMER,
        )
        traceparent, produced = tracing.traceparent_of(span), None
    if traceparent is not None and traceparent != request.traceparent:
        request = request.model_copy(update={"traceparent": traceparent})
    return request, produced


_consumer = {"messaging.system": "kafka", "messaging.operation.type": "receive"}


def placing(held: Held, decision: Decision, block_size: int, started: float) -> Span | None:
    """The spans of the request's way here, and the placement's span, started at `started` (epoch
    seconds); `held.request` then carries the placement's span for the worker."""
    if not tracing.ENABLED:
        return None
    request = held.request
    parent = tracing.parent(held.traceparent)
    attrs = tracing.request_attributes(request)
    now = time.time()
    arrived = now - (time.monotonic() - held.arrived)
    # A placement tried again (the place script failed, or a moved request's log grew) records only the
    # time since the last try.
    since = max(arrived, held.traced_to)
    held.traced_to = started
    if held.produced_at is not None and since == arrived:
        tracing.record(
            f"{held.partition[0] if held.partition else 'requests'} receive",
            parent,
            min(held.produced_at, arrived),
            arrived,
            {**attrs, **_consumer},
            SpanKind.CONSUMER,
        )
    if held.taken_over is not None:
        resume = request.resume
        tracing.record(
            "migration",
            parent,
            since,
            started,
            {
                **attrs,
                "sluice.moved_from": held.moved_from,
                "sluice.delivered_tokens": 0 if resume is None else resume.delivered_tokens,
                "sluice.migrations": 0 if resume is None else resume.migrations,
            },
        )
    elif started > since:
        tracing.record("hold", parent, since, started, {**attrs, "sluice.hold_reason": held.waited_for})
    runner_up = decision.runner_up
    span = tracing.start(
        "placement",
        parent,
        started,
        {
            **attrs,
            tracing.WORKER: decision.worker_id,
            tracing.CACHED_TOKENS: decision.matched_blocks * block_size,
            "sluice.placement.score": decision.score,
            "sluice.placement.predicted_ttft_s": decision.predicted_ttft_s,
            "sluice.placement.runner_up": runner_up,
            "sluice.placement.runner_up_score": decision.runner_up_score if runner_up else None,
            "sluice.handoff": None if request.handoff is None else request.handoff.prefill_worker,
        },
    )
    held.request = request.model_copy(update={"traceparent": tracing.traceparent_of(span)})
    return span


def placed(span: Span | None, held: Held, outcome: str) -> None:
    """End the placement's span; a request not placed goes back to the trace it came with."""
    if span is None:
        return
    tracing.set_attributes(span, {tracing.OUTCOME: outcome})
    tracing.end(span, error=None if outcome in ("placed", "redelivered") else outcome)
    if outcome not in ("placed", "redelivered"):
        held.request = held.request.model_copy(update={"traceparent": held.traceparent})

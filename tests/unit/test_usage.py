"""Usage events: how they are built from a request, and how `sluice usage` sums them."""

from __future__ import annotations

import datetime as dt

import pytest

from infra.usage_cli import parse_since
from infra.usage_report import aggregate, usage_table
from queue_schemas.messages import BatchTicket, InferenceRequest, Resume, SamplingParams, Usage
from queue_schemas.usage import Timing, UsageEvent, UsageStatus, usage_event


def request(**over: object) -> InferenceRequest:
    base: dict[str, object] = {
        "request_id": "req-00000001", "pool": "chat", "model": "llama", "team": "acme", "key_id": "sk-ab",
        "prompt_token_ids": (1, 2, 3), "sampling": SamplingParams(max_tokens=10), "created_at": 100.0,
        "deadline": 700.0,
    }  # fmt: skip
    return InferenceRequest.model_validate({**base, **over})


def test_an_event_from_a_completed_request() -> None:
    usage = Usage(prompt_tokens=3, completion_tokens=7, cached_tokens=2)
    event = usage_event(
        request(), UsageStatus.COMPLETED, usage, 105.0, Timing(began=100.5, first_token=101.0)
    )
    assert (event.team, event.key_id, event.pool, event.model, event.kind) == (
        "acme", "sk-ab", "chat", "llama", "interactive",
    )  # fmt: skip
    assert (event.prompt_tokens, event.cached_tokens, event.completion_tokens) == (3, 2, 7)
    assert (event.queue_s, event.ttft_s, event.total_s) == (0.5, 1.0, 5.0)
    assert event.charged_tokens == 0  # the settle script knows what was charged; the relay fills it in
    assert event.batch_request_id is None


def test_an_adapter_a_batch_line_and_a_moved_request() -> None:
    ticket = BatchTicket(request_id="nightly-7", custom_id="c7")
    event = usage_event(
        request(adapter="sql", batch=ticket), UsageStatus.FAILED, None, 101.0, error_code="timeout"
    )
    assert (event.model, event.kind, event.batch_request_id, event.error_code) == (
        "sql",
        "batch",
        "nightly-7",
        "timeout",
    )
    assert (event.prompt_tokens, event.completion_tokens, event.queue_s, event.ttft_s) == (0, 0, None, None)
    resume = Resume(prompt_tokens=2, delivered_tokens=1, max_tokens=11, next_seq=1, text="x", migrations=1)
    moved = usage_event(request(resume=resume), UsageStatus.COMPLETED, None, 101.0, Timing(100.2, 100.4))
    assert moved.ttft_s is None  # its first token came from the worker before


def event(
    rid: str, team: str = "acme", model: str = "llama", ended: float = 1_764_000_000.0, **over: object
) -> UsageEvent:
    base: dict[str, object] = {
        "request_id": rid, "team": team, "pool": "chat", "model": model, "kind": "interactive",
        "status": "completed", "prompt_tokens": 10, "completion_tokens": 5, "charged_tokens": 15,
        "total_s": 1.0, "created_at": ended - 1, "ended_at": ended,
    }  # fmt: skip
    return UsageEvent.model_validate({**base, **over})


def test_aggregate_by_model_and_day_counts_a_request_once() -> None:
    day = 86400.0
    events = [
        event("a"), event("a"), event("b", model="sql", cached_tokens=4),
        event("c", ended=1_764_000_000.0 + day, status="cancelled", charged_tokens=3),
        event("d", team="other"), event("e", ended=1_763_000_000.0),
    ]  # fmt: skip
    by_model = aggregate(events, "acme", 1_763_500_000.0, "model")
    assert {k: (r.requests, r.charged_tokens, r.cached_tokens) for k, r in by_model.items()} == {
        "llama": (2, 18, 0), "sql": (1, 15, 4),
    }  # fmt: skip
    by_day = aggregate(events, "acme", 1_763_500_000.0, "day")
    assert list(by_day) == ["2025-11-24", "2025-11-25"]
    assert by_day["2025-11-25"].statuses == {"cancelled": 1}
    table = usage_table(by_model, "model").splitlines()
    assert table[0].split() == ["model", "requests", "prompt", "cached", "completion", "charged", "statuses"]
    assert table[-1].split() == ["total", "3", "30", "4", "15", "33", "cancelled=1", "completed=2"]


def test_since_takes_dates_times_and_spans() -> None:
    now = dt.datetime(2026, 12, 1, 12, tzinfo=dt.UTC)
    assert parse_since("2026-11-30", now) == dt.datetime(2026, 11, 30, tzinfo=dt.UTC).timestamp()
    assert parse_since("7d", now) == now.timestamp() - 7 * 86400
    assert parse_since("12h", now) == now.timestamp() - 12 * 3600
    with pytest.raises(ValueError, match="--since"):
        parse_since("last tuesday", now)

"""Usage events: one record per ended request on `<prefix>.usage`, for chargeback and reconciliation.

Whoever ends a request (the worker that served it, the dispatcher that dropped it) settles its quota
reservation, and the settle script (plumbing.quota) writes the event to the team's outbox stream in
the same step, with what the team was charged filled in by the script. A per-request mark makes that
happen once, however many services try. The relay (ingress.usage_relay) produces outbox entries to
Kafka and deletes them once the broker has them. docs/usage.md documents the record.

Pure: building events and aggregating them. Reading and producing live in the services.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from pydantic import Field

from queue_schemas.messages import InferenceRequest, Message, Name, Usage

# How long a request's "usage recorded" mark outlives the request's deadline (past it, nothing ends
# the request again).
USAGE_MARK_MARGIN_S = 3600.0


class UsageStatus(StrEnum):
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    FAILED = "failed"


class UsageEvent(Message):
    """What one request used and was charged."""

    request_id: str = Field(description="sluice's request id (the key of the Kafka record)")
    team: Name
    key_id: str | None = Field(
        default=None, description="the API key id (HTTP) or signing key id (Kafka batch) that sent it"
    )
    pool: Name
    model: str = Field(description="the model the client asked for (a LoRA adapter's name, if one)")
    kind: Literal["interactive", "batch"]
    status: UsageStatus
    error_code: str | None = None
    prompt_tokens: int = Field(ge=0)
    cached_tokens: int = Field(default=0, ge=0, description="of prompt_tokens, served from a prefix cache")
    completion_tokens: int = Field(ge=0)
    charged_tokens: int = Field(
        default=0, ge=0, description="what the team's quota was charged for it (its daily counter)"
    )
    queue_s: float | None = Field(default=None, description="admission to the start on a worker")
    ttft_s: float | None = Field(default=None, description="admission to the first output token")
    total_s: float = Field(ge=0, description="admission to the end")
    created_at: float = Field(description="epoch seconds of admission")
    ended_at: float
    batch_request_id: str | None = Field(default=None, description="the submitter's id of a batch line")
    deadline: float = Field(exclude=True, default=0.0, description="the request's; bounds its mark's life")


def usage_mark_ttl_ms(event: UsageEvent) -> int:
    """How long the request's mark is kept: until an hour past the request's deadline."""
    return int((max(0.0, event.deadline - event.ended_at) + USAGE_MARK_MARGIN_S) * 1000)


@dataclass(frozen=True, slots=True)
class Timing:
    """Epoch seconds of a request's milestones, as the service that ends it saw them."""

    began: float | None = None  # taken off the worker's inbox
    first_token: float | None = None
    ended: float | None = None  # its last chunk first handed to Redis; a batch answer's delivery


def usage_event(
    request: InferenceRequest,
    status: UsageStatus,
    usage: Usage | None,
    now: float,
    timing: Timing = Timing(),
    error_code: str | None = None,
) -> UsageEvent:
    """The event of a request that ends now. A request that moved off a lost worker has no TTFT of its
    own here (its first tokens came from the worker before)."""
    created = request.created_at
    ttft = None
    if timing.first_token is not None and request.resume is None:
        ttft = max(0.0, timing.first_token - created)
    return UsageEvent(
        request_id=request.request_id,
        team=request.team,
        key_id=request.key_id,
        pool=request.pool,
        model=request.adapter or request.model,
        kind="batch" if request.batch is not None else "interactive",
        status=status,
        error_code=error_code,
        prompt_tokens=0 if usage is None else usage.prompt_tokens,
        cached_tokens=0 if usage is None else usage.cached_tokens,
        completion_tokens=0 if usage is None else usage.completion_tokens,
        queue_s=None if timing.began is None else max(0.0, timing.began - created),
        ttft_s=ttft,
        total_s=max(0.0, now - created),
        created_at=created,
        ended_at=now,
        batch_request_id=None if request.batch is None else request.batch.request_id,
        deadline=request.deadline,
    )

"""A team's record: its quota limits, the topic prefixes it owns and its share in the fair order."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from queue_schemas.messages import Name


class TeamLimits(BaseModel):
    """None means unlimited."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tokens_per_minute: int | None = Field(default=None, gt=0)
    requests_per_minute: int | None = Field(default=None, gt=0)
    daily_tokens: int | None = Field(default=None, gt=0)


class TeamRecord(BaseModel):
    """What `team:<team>` holds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    team: Name
    limits: TeamLimits = TeamLimits()
    reply_prefixes: tuple[str, ...] = Field(
        default=(), description="topic prefixes the team owns for batch answers, beside its results topic"
    )
    weight: float = Field(
        default=1.0,
        gt=0,
        le=1000,
        description="the team's share in the dispatcher's fair order: tokens served count 1/weight",
    )

"""`sluice usage`: a team's usage events summed per day, per model or in total, as a text table."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from queue_schemas.usage import UsageEvent


@dataclass
class UsageRow:
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    charged_tokens: int = 0
    statuses: dict[str, int] = field(default_factory=dict)

    def add(self, event: UsageEvent) -> None:
        self.requests += 1
        self.prompt_tokens += event.prompt_tokens
        self.cached_tokens += event.cached_tokens
        self.completion_tokens += event.completion_tokens
        self.charged_tokens += event.charged_tokens
        self.statuses[event.status.value] = self.statuses.get(event.status.value, 0) + 1


def usage_day(event: UsageEvent) -> str:
    return dt.datetime.fromtimestamp(event.ended_at, dt.UTC).strftime("%Y-%m-%d")


def aggregate(
    events: Iterable[UsageEvent], team: str, since: float, by: Literal["day", "model", "total"]
) -> dict[str, UsageRow]:
    """The team's usage of requests ended at or after `since`, per day, per model or in total. An event
    seen twice (the relay re-produces an entry when it dies between the broker's ack and its own) counts
    once: request ids are unique."""
    rows: dict[str, UsageRow] = {}
    seen: set[str] = set()
    for event in events:
        if event.team != team or event.ended_at < since or event.request_id in seen:
            continue
        seen.add(event.request_id)
        key = usage_day(event) if by == "day" else event.model if by == "model" else "total"
        rows.setdefault(key, UsageRow()).add(event)
    return dict(sorted(rows.items()))


def usage_table(rows: dict[str, UsageRow], by: str) -> str:
    """The rows as an aligned text table with a total line."""
    header = (by, "requests", "prompt", "cached", "completion", "charged", "statuses")
    total = UsageRow()
    lines: list[tuple[str, ...]] = []
    for key, row in rows.items():
        lines.append(_cells(key, row))
        total.requests += row.requests
        total.prompt_tokens += row.prompt_tokens
        total.cached_tokens += row.cached_tokens
        total.completion_tokens += row.completion_tokens
        total.charged_tokens += row.charged_tokens
        for status, n in row.statuses.items():
            total.statuses[status] = total.statuses.get(status, 0) + n
    if by != "total":
        lines.append(_cells("total", total))
    table = [header, *lines]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            cell.ljust(w) if i in (0, 6) else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in table
    )


def _cells(key: str, row: UsageRow) -> tuple[str, ...]:
    statuses = " ".join(f"{k}={v}" for k, v in sorted(row.statuses.items()))
    return (
        key,
        f"{row.requests:,}",
        f"{row.prompt_tokens:,}",
        f"{row.cached_tokens:,}",
        f"{row.completion_tokens:,}",
        f"{row.charged_tokens:,}",
        statuses,
    )

"""Team token quotas: the limits, the Redis layout and the two atomic scripts every service shares.

Admission reserves prompt + max_tokens against three limits at once: tokens per minute and requests per
minute (token buckets holding up to one minute's allowance, refilled continuously) and a daily token
budget (a counter per UTC day). Whoever ends a request (the worker that served it, the dispatcher that
dropped it, ingress if it never got queued) settles it with the tokens really used: the unused part of
the reservation goes back to the minute bucket and the day's counter. Settling is idempotent: the
reservation record is deleted by the first settle, so a second one refunds nothing.

Settling a request that ended also writes its usage event (queue_schemas.usage), in the same script.
Every key a script touches is in the team's hash slot.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from plumbing.protocol.quota import SETTLE_SCRIPT, settle_keys
from queue_schemas.names import Names
from queue_schemas.usage import UsageEvent, usage_mark_ttl_ms


@dataclass(frozen=True, slots=True)
class Reservation:
    """The result of a reserve call, with what is left after it (None where a limit is not set)."""

    verdict: int
    retry_after_ms: int
    tokens_left: float | None
    requests_left: float | None
    daily_used: int

    @classmethod
    def from_script(cls, reply: list[object]) -> Reservation:
        verdict, retry_ms, tokens, requests, daily = (_number(x) for x in reply)
        return cls(
            verdict=int(verdict),
            retry_after_ms=int(retry_ms),
            tokens_left=None if tokens < 0 else tokens,
            requests_left=None if requests < 0 else requests,
            daily_used=int(daily),
        )


def _number(value: object) -> float:
    """Script replies arrive as ints or as bytes/str holding a number."""
    if isinstance(value, bytes):
        value = value.decode()
    return float(str(value))


def seconds_to_refill(left: float, limit: int) -> float:
    """How long a one-minute bucket holding `left` of `limit` takes to be full again."""
    return max(0.0, (limit - left) * 60.0 / limit)


async def settle(
    redis: aioredis.Redis,
    names: Names,
    team: str,
    request_id: str,
    used_tokens: int,
    usage: UsageEvent | None = None,
    unreserved: bool = False,
) -> int:
    """Settle a request's reservation with the tokens it really used; returns the refund (-1: none held).

    With `usage`, the request has ended: its usage event is written with the settlement, once per
    request. `unreserved` writes it even when no reservation is held (a batch request answered before a
    worker was found); without it, a settle that finds nothing (a second one) writes nothing."""
    now = time.time()
    keys = settle_keys(names, team, request_id, now)
    event, mark_ttl_ms = b"", 0
    if usage is not None:
        event, mark_ttl_ms = usage.model_dump_json().encode(), usage_mark_ttl_ms(usage)
        await register_outbox(redis, names, team)
    args = (int(now * 1000), used_tokens, event, "1" if unreserved else "0", mark_ttl_ms)
    refund = await redis.eval(SETTLE_SCRIPT, len(keys), *keys, *args)
    return int(refund)


_registered: dict[tuple[str, str], float] = {}  # (prefix, team) -> when this process last registered it
REGISTER_AGAIN_S = 600.0


async def register_outbox(redis: aioredis.Redis, names: Names, team: str) -> None:
    """Name the team's outbox where relays look, before its first event is written (so no event waits
    on a team the relays do not know). Once per team per process every few minutes: the set only grows."""
    key, now = (names.prefix, team), time.monotonic()
    if now - _registered.get(key, -REGISTER_AGAIN_S) < REGISTER_AGAIN_S:
        return
    await redis.sadd(names.usage_teams(), team)
    _registered[key] = now

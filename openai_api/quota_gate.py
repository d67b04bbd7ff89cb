"""Quota admission: reserve a request's tokens against its team's limits, or refuse with a 429.

The arithmetic is in plumbing.quota's Lua scripts, so reservations are atomic across ingress
processes. Building headers and errors from a reservation is pure (`rate_limit_headers`, `refusal`).
"""

from __future__ import annotations

import math
import time

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from openai_api.errors import ApiError, InsufficientQuota, RateLimited, ServiceUnavailable
from plumbing.protocol.quota import RESERVE_SCRIPT, Verdict, reserve_keys, utc_day
from plumbing.quota import Reservation, seconds_to_refill
from queue_schemas.names import Names
from queue_schemas.teams import TeamLimits

MAX_RETRY_AFTER_S = 120
DAY_COUNTER_TTL_S = 3 * 24 * 3600


def _duration(seconds: float) -> str:
    """OpenAI's reset format: '6m0s', '1.5s', '20ms'."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, rest = divmod(seconds, 60)
    return f"{int(minutes)}m{rest:.0f}s" if minutes else f"{rest:.3g}s"


def rate_limit_headers(limits: TeamLimits, r: Reservation) -> dict[str, str]:
    headers: dict[str, str] = {}
    if limits.requests_per_minute is not None and r.requests_left is not None:
        headers["x-ratelimit-limit-requests"] = str(limits.requests_per_minute)
        headers["x-ratelimit-remaining-requests"] = str(max(0, math.floor(r.requests_left)))
        headers["x-ratelimit-reset-requests"] = _duration(
            seconds_to_refill(r.requests_left, limits.requests_per_minute)
        )
    if limits.tokens_per_minute is not None and r.tokens_left is not None:
        headers["x-ratelimit-limit-tokens"] = str(limits.tokens_per_minute)
        headers["x-ratelimit-remaining-tokens"] = str(max(0, math.floor(r.tokens_left)))
        headers["x-ratelimit-reset-tokens"] = _duration(
            seconds_to_refill(r.tokens_left, limits.tokens_per_minute)
        )
    return headers


def refusal(limits: TeamLimits, r: Reservation, cost: int) -> ApiError:
    """The 429 for a refused reservation, with the headers the official client's retry logic reads."""
    headers = rate_limit_headers(limits, r)
    if r.verdict in (Verdict.TOKENS_PER_MINUTE, Verdict.REQUESTS_PER_MINUTE):
        wait_s = min(MAX_RETRY_AFTER_S, r.retry_after_ms / 1000)
        headers["retry-after"] = str(max(1, math.ceil(wait_s)))
        headers["retry-after-ms"] = str(max(1, math.ceil(wait_s * 1000)))
        what = "tokens" if r.verdict == Verdict.TOKENS_PER_MINUTE else "requests"
        limit = limits.tokens_per_minute if what == "tokens" else limits.requests_per_minute
        err: ApiError = RateLimited(
            f"Rate limit reached for {what} per minute (limit {limit}). Please try again in {wait_s:.2f}s.",
            headers=headers,
        )
        err.type = what
        return err
    headers["x-should-retry"] = "false"
    if r.verdict == Verdict.LARGER_THAN_LIMIT:
        return InsufficientQuota(
            f"This request needs {cost} tokens (prompt + max_tokens), more than the team's limit of "
            f"{limits.tokens_per_minute} tokens per minute. Lower max_tokens or the prompt.",
            headers=headers,
            code="rate_limit_exceeded",
        )
    return InsufficientQuota(
        f"The team's daily token budget ({limits.daily_tokens}) is spent ({r.daily_used} used).",
        headers=headers,
    )


class QuotaGate:
    def __init__(self, redis: aioredis.Redis, names: Names) -> None:
        self._redis = redis
        self._names = names
        self._reserve = redis.register_script(RESERVE_SCRIPT)

    async def reserve(
        self, team: str, limits: TeamLimits, request_id: str, cost: int, hold_s: float
    ) -> dict[str, str]:
        """Reserve `cost` tokens and one request for `hold_s`; return the rate-limit headers, or raise 429."""
        now = time.time()
        names = self._names
        try:
            reply = await self._reserve(
                keys=reserve_keys(names, team, request_id, now),
                args=[
                    int(now * 1000),
                    cost,
                    limits.tokens_per_minute or 0,
                    limits.requests_per_minute or 0,
                    limits.daily_tokens or 0,
                    int(hold_s * 1000),
                    DAY_COUNTER_TTL_S,
                ],
            )
        except RedisError as exc:
            raise ServiceUnavailable("The quota store is unreachable; retry shortly.") from exc
        reservation = Reservation.from_script(reply)
        if reservation.verdict != Verdict.ADMITTED:
            raise refusal(limits, reservation, cost)
        return rate_limit_headers(limits, reservation)


async def day_budget_left(redis: aioredis.Redis, names: Names, team: str, limits: TeamLimits) -> int | None:
    """Tokens left of the team's daily budget (None: no daily limit), read without reserving: the cheap
    check made before work whose cost is not known yet (a batch, a batch line before tokenizing)."""
    if not limits.daily_tokens:
        return None
    used = await redis.get(names.quota_day(team, utc_day(time.time())))  # RedisError: the caller's
    return limits.daily_tokens - int(used or 0)

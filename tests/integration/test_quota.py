"""The quota scripts on a real Redis-compatible server: exact arithmetic, atomic under concurrency."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from openai_api.errors import InsufficientQuota, RateLimited
from openai_api.quota_gate import QuotaGate
from plumbing.clients import redis_client
from plumbing.protocol.quota import utc_day
from plumbing.quota import settle
from queue_schemas.names import Names
from queue_schemas.teams import TeamLimits
from tests.conftest import Bus

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def redis(bus: Bus) -> AsyncIterator[tuple[aioredis.Redis, Names]]:
    settings = bus.settings()
    client = redis_client(settings)
    yield client, settings.names
    await client.aclose()


async def day_used(redis: aioredis.Redis, names: Names, team: str) -> int:
    return int(await redis.get(names.quota_day(team, utc_day(time.time()))) or 0)


async def test_reserve_then_settle_charges_real_usage(redis: tuple[aioredis.Redis, Names]) -> None:
    client, names = redis
    gate = QuotaGate(client, names)
    limits = TeamLimits(tokens_per_minute=1000, requests_per_minute=10, daily_tokens=5000)
    headers = await gate.reserve("a", limits, "req-00000001", cost=300, hold_s=60)
    assert headers["x-ratelimit-limit-tokens"] == "1000"
    assert int(headers["x-ratelimit-remaining-tokens"]) in (700, 701)
    assert headers["x-ratelimit-remaining-requests"] == "9"
    assert await day_used(client, names, "a") == 300

    assert await settle(client, names, "a", "req-00000001", 120) == 180
    assert await day_used(client, names, "a") == 120
    assert await settle(client, names, "a", "req-00000001", 0) == -1, "a second settle must refund nothing"
    assert await day_used(client, names, "a") == 120


async def test_each_limit_refuses_with_its_own_error(redis: tuple[aioredis.Redis, Names]) -> None:
    client, names = redis
    gate = QuotaGate(client, names)

    rpm = TeamLimits(requests_per_minute=2)
    await gate.reserve("b", rpm, "req-b0000001", cost=1, hold_s=60)
    await gate.reserve("b", rpm, "req-b0000002", cost=1, hold_s=60)
    with pytest.raises(RateLimited) as limited:
        await gate.reserve("b", rpm, "req-b0000003", cost=1, hold_s=60)
    assert limited.value.type == "requests"
    assert 1 <= int(limited.value.headers["retry-after"]) <= 30

    tpm = TeamLimits(tokens_per_minute=600)
    await gate.reserve("c", tpm, "req-c0000001", cost=590, hold_s=60)
    with pytest.raises(RateLimited) as tokens:
        await gate.reserve("c", tpm, "req-c0000002", cost=70, hold_s=60)
    assert tokens.value.type == "tokens"
    assert 5000 <= int(tokens.value.headers["retry-after-ms"]) <= 6000  # 60 tokens at 10 tokens/s
    with pytest.raises(InsufficientQuota) as too_big:
        await gate.reserve("c", tpm, "req-c0000003", cost=601, hold_s=60)
    assert too_big.value.headers["x-should-retry"] == "false"

    daily = TeamLimits(daily_tokens=100)
    await gate.reserve("d", daily, "req-d0000001", cost=60, hold_s=60)
    with pytest.raises(InsufficientQuota) as spent:
        await gate.reserve("d", daily, "req-d0000002", cost=60, hold_s=60)
    assert spent.value.code == "insufficient_quota"


async def test_refund_returns_tokens_to_the_minute_bucket(redis: tuple[aioredis.Redis, Names]) -> None:
    client, names = redis
    gate = QuotaGate(client, names)
    limits = TeamLimits(tokens_per_minute=600)
    await gate.reserve("e", limits, "req-e0000001", cost=590, hold_s=60)
    with pytest.raises(RateLimited):
        await gate.reserve("e", limits, "req-e0000002", cost=300, hold_s=60)
    await settle(client, names, "e", "req-e0000001", 100)  # 490 back
    await gate.reserve("e", limits, "req-e0000003", cost=300, hold_s=60)


async def test_concurrent_reservations_never_exceed_the_budget(redis: tuple[aioredis.Redis, Names]) -> None:
    client, names = redis
    gate = QuotaGate(client, names)
    limits = TeamLimits(daily_tokens=1000)

    async def attempt(i: int) -> bool:
        try:
            await gate.reserve("f", limits, f"req-f{i:07d}", cost=90, hold_s=60)
        except InsufficientQuota:
            return False
        return True

    admitted = await asyncio.gather(*(attempt(i) for i in range(50)))
    assert sum(admitted) == 11  # floor(1000 / 90)
    assert await day_used(client, names, "f") == 11 * 90

"""Usage events on a real Redis and broker: the settle script writes one per request, whoever settles
and however often; relays move them to the usage topic, and a dead relay's entries are taken over."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer

from infra.usage_cli import read_usage
from ingress.usage_relay import RELAY_GROUP, UsageRelay
from openai_api.quota_gate import QuotaGate
from plumbing.clients import producer_options, redis_client
from plumbing.protocol.quota import utc_day
from plumbing.quota import settle
from queue_schemas.messages import InferenceRequest, SamplingParams, Usage
from queue_schemas.settings import BusSettings
from queue_schemas.teams import TeamLimits
from queue_schemas.usage import UsageEvent, UsageStatus, usage_event
from tests.conftest import Bus
from tests.integration.helpers import create_topics
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def bus_parts(bus: Bus) -> AsyncIterator[tuple[BusSettings, aioredis.Redis, AIOKafkaProducer]]:
    settings = bus.settings()
    await create_topics(settings, settings.names.usage_topic())
    redis = redis_client(settings)
    producer = AIOKafkaProducer(**producer_options(settings))
    await producer.start()
    yield settings, redis, producer
    await producer.stop()
    await redis.aclose()


def request(rid: str, team: str = "acme") -> InferenceRequest:
    return InferenceRequest(
        request_id=rid, pool="sim", model="sluice-sim", team=team, key_id="sk-1", prompt_token_ids=(1, 2, 3),
        sampling=SamplingParams(max_tokens=100), created_at=time.time() - 1, deadline=time.time() + 60,
    )  # fmt: skip


def completed(rid: str, completion: int) -> tuple[int, UsageEvent]:
    usage = Usage(prompt_tokens=3, completion_tokens=completion)
    return usage.total_tokens, usage_event(request(rid), UsageStatus.COMPLETED, usage, time.time())


async def test_one_event_per_request_with_what_was_charged(
    bus_parts: tuple[BusSettings, aioredis.Redis, AIOKafkaProducer],
) -> None:
    settings, redis, _ = bus_parts
    names = settings.names
    gate = QuotaGate(redis, names)
    await gate.reserve("acme", TeamLimits(daily_tokens=10_000), "req-00000001", cost=103, hold_s=60)
    used, event = completed("req-00000001", 40)
    assert await settle(redis, names, "acme", "req-00000001", used, event) == 60
    # A second settle (another service ending the same request) refunds and records nothing.
    assert await settle(redis, names, "acme", "req-00000001", 0, event, unreserved=True) == -1
    # A request that ended before it reserved anything is recorded only when asked, with 0 charged.
    failed = usage_event(request("req-00000002"), UsageStatus.FAILED, None, time.time(), error_code="timeout")
    assert await settle(redis, names, "acme", "req-00000002", 0, failed) == -1
    assert await settle(redis, names, "acme", "req-00000002", 0, failed, unreserved=True) == -1
    assert await settle(redis, names, "acme", "req-00000002", 0, failed, unreserved=True) == -1
    entries: Any = await redis.xrange(names.usage_outbox("acme"))
    written = [(UsageEvent.model_validate_json(f[b"e"]).request_id, f[b"charged"]) for _, f in entries]
    assert written == [("req-00000001", b"43"), ("req-00000002", b"0")]
    assert int(await redis.get(names.quota_day("acme", utc_day(time.time()))) or 0) == 43


async def test_relays_move_each_entry_once_and_take_over_a_dead_ones(
    bus_parts: tuple[BusSettings, aioredis.Redis, AIOKafkaProducer],
) -> None:
    settings, redis, producer = bus_parts
    names = settings.names
    for n, team in enumerate(["acme", "acme", "beta"]):
        rid = f"req-1000000{n}"
        await QuotaGate(redis, names).reserve(team, TeamLimits(), rid, cost=50, hold_s=60)
        event = usage_event(
            request(rid, team),
            UsageStatus.COMPLETED,
            Usage(prompt_tokens=3, completion_tokens=n),
            time.time(),
        )
        await settle(redis, names, team, rid, 3 + n, event)
    first = UsageRelay(names, redis, producer, interval_s=0.1, claim_idle_s=0.5)
    assert await first.relay_once() == 3
    assert await first.relay_once() == 0  # acknowledged and deleted: nothing is sent twice
    events = await read_usage(settings)
    assert sorted((e.team, e.request_id, e.charged_tokens) for e in events) == [
        ("acme", "req-10000000", 3), ("acme", "req-10000001", 4), ("beta", "req-10000002", 5),
    ]  # fmt: skip
    assert [await redis.xlen(names.usage_outbox(t)) for t in ("acme", "beta")] == [0, 0]

    # A relay that read an entry and died before sending it: another takes the entry once it is idle.
    await QuotaGate(redis, names).reserve("acme", TeamLimits(), "req-20000000", cost=50, hold_s=60)
    _, event = completed("req-20000000", 7)
    await settle(redis, names, "acme", "req-20000000", 10, event)
    taken: Any = await redis.xreadgroup(
        RELAY_GROUP, "dead-relay", {names.usage_outbox("acme"): ">"}, count=10
    )
    assert len(taken[0][1]) == 1
    second = UsageRelay(names, redis, producer, interval_s=0.1, claim_idle_s=0.5)
    await eventually(lambda: second.relay_once(), within_s=10, what="the dead relay's entry taken over")
    ids = [e.request_id for e in await read_usage(settings)]
    assert ids.count("req-20000000") == 1
    assert len(ids) == 4

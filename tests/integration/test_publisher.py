"""Pipelined pub/sub publishing against the real Redis-compatible server."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from plumbing.clients import redis_client
from plumbing.publisher import PipelinedPublisher
from tests.conftest import Bus

pytestmark = pytest.mark.timeout(60)


async def test_concurrent_publishes_share_round_trips_and_keep_per_channel_order(bus: Bus) -> None:
    redis = redis_client(bus.settings())
    listener = aioredis.Redis.from_url(bus.redis_url)
    pubsub = listener.pubsub()
    channels = [f"pub-test:{i}" for i in range(8)]
    await pubsub.subscribe(*channels)
    for _ in channels:
        await pubsub.get_message(timeout=2)  # subscribe confirmations
    publisher = PipelinedPublisher(redis)
    try:
        await publisher.publish(channels[0], b"first")
        assert (publisher.round_trips, publisher.published) == (1, 1), "a lone message goes out at once"

        async def stream(channel: str) -> None:
            for n in range(50):
                await publisher.publish(channel, str(n).encode())

        await asyncio.gather(*(stream(c) for c in channels))
        received: dict[str, list[bytes]] = {c: [] for c in channels}
        while sum(len(v) for v in received.values()) < 1 + 50 * len(channels):
            message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=2)
            assert message is not None, "a published message never arrived"
            received[message["channel"].decode()].append(message["data"])
        assert received[channels[0]][0] == b"first"
        received[channels[0]].pop(0)
        for channel in channels:
            assert received[channel] == [str(n).encode() for n in range(50)], channel
        assert publisher.published == 401
        assert publisher.round_trips < 401 / 4, "eight concurrent streams shared their round trips"
    finally:
        await publisher.close()
        await pubsub.aclose()
        await listener.aclose()
        await redis.aclose()


async def test_a_failed_round_trip_fails_its_waiters_and_the_next_one_retries() -> None:
    unreachable = aioredis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.5)
    publisher = PipelinedPublisher(unreachable)
    try:
        results = await asyncio.gather(
            *(publisher.publish("c", b"x") for _ in range(5)), return_exceptions=True
        )
        assert all(isinstance(r, RedisConnectionError) for r in results), results
        with pytest.raises(RedisConnectionError):
            await publisher.publish("c", b"again")  # the sender is still alive and tries again
    finally:
        await publisher.close()
        await unreachable.aclose()

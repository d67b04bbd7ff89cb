"""Several readers of one stream in one ingress process share its subscription, against the real
Redis-compatible server: each gets every message, and the channel stays subscribed until the last one
closes."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from ingress.streams import StreamHub
from plumbing.clients import redis_client
from tests.conftest import Bus
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(60)


async def test_two_readers_of_one_channel_each_get_every_message(bus: Bus) -> None:
    settings = bus.settings()
    names = settings.names
    hub = StreamHub(redis_client(settings, retry=False), names.ingress_control_channel())
    await hub.start()
    await hub.wait_ready(5)
    publisher = aioredis.Redis.from_url(bus.redis_url)
    channel = names.stream_channel("c" * 32)
    try:
        first, second = await asyncio.gather(hub.subscribe(channel), hub.subscribe(channel))
        assert hub.open_subscriptions == 2
        assert await publisher.publish(channel, b"one") == 1  # one connection carries both
        assert await first.next(5) == b"one"
        assert await second.next(5) == b"one"
        await first.close()
        assert await publisher.publish(channel, b"two") == 1  # still subscribed for the other
        assert await second.next(5) == b"two"
        await second.close()
        assert hub.open_subscriptions == 0

        async def unsubscribed() -> bool:
            return bool(await publisher.pubsub_numsub(channel) == [(channel.encode(), 0)])

        await eventually(unsubscribed, 5, "the channel unsubscribed after its last reader closed")
    finally:
        await hub.close()
        await publisher.aclose()

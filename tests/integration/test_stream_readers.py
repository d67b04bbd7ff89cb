"""Readers of streams in one ingress process, against the real Redis-compatible server: several readers
of one stream share its subscription, each gets every message, and the channel stays subscribed until
the last one closes; a burst of messages is read in batches, in order."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis
from redis.asyncio.client import PubSub

from ingress import streams
from ingress.pubsub_replies import read_replies
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
        assert await first.next(time.time() + 5) == b"one"
        assert await second.next(time.time() + 5) == b"one"
        await first.close()
        assert await publisher.publish(channel, b"two") == 1  # still subscribed for the other
        assert await second.next(time.time() + 5) == b"two"
        await second.close()
        assert hub.open_subscriptions == 0

        async def unsubscribed() -> bool:
            return bool(await publisher.pubsub_numsub(channel) == [(channel.encode(), 0)])

        await eventually(unsubscribed, 5, "the channel unsubscribed after its last reader closed")
    finally:
        await hub.close()
        await publisher.aclose()


async def test_a_burst_is_read_in_batches_in_order_and_closed_streams_are_forgotten(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = bus.settings()
    names = settings.names
    reads: list[int] = []

    async def counted(pubsub: PubSub, wait_s: float) -> list[object]:
        replies = await read_replies(pubsub, wait_s)
        reads.append(len(replies))
        return replies

    monkeypatch.setattr(streams, "read_replies", counted)
    hub = StreamHub(redis_client(settings, retry=False), names.ingress_control_channel())
    await hub.start()
    await hub.wait_ready(5)
    publisher = aioredis.Redis.from_url(bus.redis_url)
    channels = [names.stream_channel(c * 32) for c in "abcd"]
    try:
        subs = [await hub.subscribe(channel) for channel in channels]
        pubsub = hub._shards[streams.SINGLE].pubsub
        assert pubsub is not None
        await pubsub.ping()  # its pong reaches the reader among the messages
        async with publisher.pipeline(transaction=False) as pipe:
            for n in range(200):
                pipe.publish(channels[n % 4], str(n).encode())
            await pipe.execute()
        for k, sub in enumerate(subs):
            got = [await sub.next(time.time() + 5) for _ in range(50)]
            assert got == [str(n).encode() for n in range(k, 200, 4)]
        assert max(reads) > 1, "replies already received are taken together"
        for sub in subs:
            await sub.close()

        async def forgotten() -> bool:
            return not any(channel.encode() in pubsub.channels for channel in channels)

        await eventually(forgotten, 5, "redis-py forgets the channels the hub dropped")
        assert hub.connected
    finally:
        await hub.close()
        await publisher.aclose()

"""How the stream hub routes the raw replies of its pub/sub connection (ingress.streams), read through
redis-py's own connection and parser fed in place of a socket: every message of a batch reaches its
readers, confirmations settle subscriptions, pongs are nothing, and a reply that cannot be routed is
dropped alone."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from prometheus_client import REGISTRY
from redis.exceptions import RedisError

from ingress.streams import HUB_ITEMS, RESYNC, SINGLE, StreamHub, Subscription, _Shard, reader_name
from plumbing.health import Liveness
from tests.unit.pubsub_wire import bulk, connected_pubsub


def failed_count() -> float:
    return REGISTRY.get_sample_value("sluice_items_failed_total", {"loop": HUB_ITEMS}) or 0.0


class Wired:
    """A hub with one shard whose connection is fed by the test, and readers of channels c and d."""

    def __init__(self) -> None:
        self.received = asyncio.StreamReader()
        self.liveness = Liveness()
        self.hub = StreamHub(aioredis.Redis(), "control", liveness=self.liveness)
        self.shard = _Shard(SINGLE, aioredis.Redis())
        self.shard.pubsub, _, _ = connected_pubsub(self.received)
        self.hub._shards[SINGLE] = self.shard
        self.reader: asyncio.Task[None] | None = None
        self.readers: dict[bytes, Subscription] = {}
        for channel in (b"c", b"d"):
            self.readers[channel] = Subscription(self.hub, channel)
            self.hub._subs[channel] = [self.readers[channel]]
            self.hub._shard_of[channel] = SINGLE
            self.shard.channels.add(channel)


@pytest.fixture
async def wired() -> AsyncIterator[Wired]:
    wiring = Wired()
    wiring.reader = asyncio.create_task(wiring.hub._read_forever(wiring.shard))
    wiring.liveness.watch(reader_name(SINGLE), wiring.reader, stale_after_s=1.5)
    yield wiring
    assert wiring.reader is not None
    wiring.reader.cancel()
    await asyncio.gather(wiring.reader, return_exceptions=True)


async def test_a_batch_of_messages_reaches_each_reader_in_order(wired: Wired) -> None:
    wired.received.feed_data(
        bulk(b"message", b"c", b"1")
        + bulk(b"smessage", b"d", b"2")
        + bulk(b"message", b"c", b"3")
        + bulk(b"message", b"elsewhere", b"4")
    )
    c, d = wired.readers[b"c"], wired.readers[b"d"]
    assert [await c.next(time.time() + 5), await c.next(time.time() + 5)] == [b"1", b"3"]
    assert await d.next(time.time() + 5) == b"2"


async def test_a_subscribe_confirmation_settles_the_subscription_and_a_pong_is_nothing(wired: Wired) -> None:
    confirmed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    wired.hub._confirm[b"e"] = confirmed
    before = failed_count()
    wired.received.feed_data(
        bulk(b"pong", b"") + bulk(b"pong", b"redis-py-health-check") + bulk(b"ssubscribe", b"e", 3)
    )
    await asyncio.wait_for(confirmed, 5)
    wired.received.feed_data(bulk(b"message", b"c", b"after"))
    assert await wired.readers[b"c"].next(time.time() + 5) == b"after", "nothing else came before it"
    assert failed_count() == before


async def test_a_reply_that_cannot_be_routed_is_dropped_alone_and_its_readers_catch_up(wired: Wired) -> None:
    before = failed_count()
    wired.received.feed_data(bulk(b"message", b"c") + bulk(b"message", b"d", b"fine"))
    assert await wired.readers[b"c"].next(time.time() + 5) == RESYNC
    assert await wired.readers[b"d"].next(time.time() + 5) == b"fine"
    assert failed_count() == before + 1


async def test_an_unrequested_sunsubscribe_rehomes_its_stream_and_redis_py_forgets_a_requested_one(
    wired: Wired, monkeypatch: pytest.MonkeyPatch
) -> None:
    moved: list[set[bytes]] = []

    async def rehome(keys: set[bytes]) -> None:
        moved.append(keys)

    monkeypatch.setattr(wired.hub, "_rehome", rehome)
    pubsub = wired.shard.pubsub
    assert pubsub is not None
    pubsub.shard_channels = {b"c": None, b"gone": None}
    pubsub.pending_unsubscribe_shard_channels = {b"gone"}
    wired.received.feed_data(bulk(b"sunsubscribe", b"gone", 1) + bulk(b"sunsubscribe", b"c", 0))
    wired.received.feed_data(bulk(b"message", b"d", b"then"))
    assert await wired.readers[b"d"].next(time.time() + 5) == b"then"
    assert moved == [{b"c"}], "only the stream the hub still reads follows its slot"
    assert b"gone" not in pubsub.shard_channels


async def test_an_idle_reader_still_beats_and_a_lost_connection_ends_its_read(wired: Wired) -> None:
    await asyncio.sleep(2.0)  # past the reader's staleness, with nothing received
    assert wired.liveness.report() == (True, {reader_name(SINGLE): "ok"})
    wired.received.feed_eof()
    assert wired.reader is not None
    with pytest.raises(RedisError, match="closed"):  # to the hub's loop, which reconnects
        await asyncio.wait_for(wired.reader, 5)

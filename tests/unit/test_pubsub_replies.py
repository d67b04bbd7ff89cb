"""Reading a pub/sub connection's replies in batches (ingress.pubsub_replies), on redis-py's own
connection and hiredis parser, fed through a stream reader in place of a socket."""

from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import RedisError, ResponseError

from ingress.pubsub_replies import (
    channel_of,
    forget_unsubscribed,
    read_replies,
    reply_kind,
    stream_message,
)
from tests.unit.pubsub_wire import bulk, connected_pubsub


async def test_every_reply_already_received_comes_in_one_read_and_a_partial_one_waits() -> None:
    received = asyncio.StreamReader()
    pubsub, _, _ = connected_pubsub(received)
    whole = bulk(b"message", b"c", b"one") + bulk(b"smessage", b"d", b"two") + bulk(b"subscribe", b"e", 2)
    partial = bulk(b"message", b"c", b"three")
    received.feed_data(whole + partial[:-4])
    assert await read_replies(pubsub, 1.0) == [
        [b"message", b"c", b"one"],
        [b"smessage", b"d", b"two"],
        [b"subscribe", b"e", 2],
    ]
    assert await read_replies(pubsub, 0.05) == [], "a reply not yet whole is not taken"
    received.feed_data(partial[-4:])
    assert await read_replies(pubsub, 1.0) == [[b"message", b"c", b"three"]]


async def test_nothing_within_the_wait_is_no_reply() -> None:
    pubsub, _, _ = connected_pubsub(asyncio.StreamReader())
    started = asyncio.get_running_loop().time()
    assert await read_replies(pubsub, 0.2) == []
    assert asyncio.get_running_loop().time() - started >= 0.19


async def test_a_read_waits_for_the_first_reply() -> None:
    received = asyncio.StreamReader()
    pubsub, _, _ = connected_pubsub(received)
    reading = asyncio.create_task(read_replies(pubsub, 5.0))
    await asyncio.sleep(0.05)
    assert not reading.done()
    received.feed_data(bulk(b"message", b"c", b"late"))
    assert await asyncio.wait_for(reading, 5) == [[b"message", b"c", b"late"]]


async def test_a_lost_or_closed_connection_and_an_error_reply_are_raised() -> None:
    received = asyncio.StreamReader()
    pubsub, _, _ = connected_pubsub(received)
    received.feed_data(bulk(b"message", b"c", b"one") + b"-ERR no such thing\r\n")
    with pytest.raises(ResponseError, match="no such thing"):
        await read_replies(pubsub, 1.0)
    received.feed_eof()
    with pytest.raises(RedisError):
        await read_replies(pubsub, 1.0)
    pubsub.connection = None
    with pytest.raises(RedisError, match="closed"):
        await read_replies(pubsub, 1.0)


async def test_a_health_check_is_sent_when_due_and_its_pong_is_a_reply() -> None:
    received = asyncio.StreamReader()
    pubsub, conn, written = connected_pubsub(received, health_check_s=0.01)
    conn.next_health_check = 0  # due
    received.feed_data(bulk(b"pong", b"redis-py-health-check"))
    assert await read_replies(pubsub, 1.0) == [[b"pong", b"redis-py-health-check"]]
    assert b"PING" in b"".join(written.sent)


async def test_an_unsubscribe_confirmation_lets_redis_py_forget_the_channel() -> None:
    pubsub, _, _ = connected_pubsub(asyncio.StreamReader())
    pubsub.channels = {b"c": None, b"d": None}
    pubsub.pending_unsubscribe_channels = {b"c"}
    pubsub.shard_channels = {b"s": None}
    pubsub.pending_unsubscribe_shard_channels = {b"s"}
    await forget_unsubscribed(pubsub, [b"unsubscribe", b"c", 1])
    await forget_unsubscribed(pubsub, [b"sunsubscribe", b"s", 0])
    assert pubsub.channels == {b"d": None}
    assert pubsub.shard_channels == {}


def test_a_reply_names_its_kind_and_channel_only_when_well_formed() -> None:
    assert reply_kind([b"smessage", b"c", b"x"]) == b"smessage"
    assert reply_kind(b"PONG") is None
    assert reply_kind([]) is None
    assert reply_kind([7, b"c"]) is None
    assert channel_of([b"sunsubscribe", b"c", 0]) == b"c"
    assert channel_of([b"pong", b"c"]) is None, "a pong's data is no channel"
    assert channel_of([b"message"]) is None


def test_only_a_well_formed_published_message_is_handed_over_directly() -> None:
    assert stream_message([b"message", b"c", b"data"]) == (b"c", b"data")
    assert stream_message([b"smessage", b"c", b""]) == (b"c", b"")
    for other in (
        [b"subscribe", b"c", 1],  # a confirmation
        [b"pmessage", b"p*", b"c", b"data"],  # a pattern's message: four parts
        [b"message", b"c"],  # short
        [b"message", [b"c"], b"data"],  # a channel that is no name
        [b"message", b"c", 5],  # a payload that is no bytes
        (b"message", b"c", b"data"),  # not as the parser builds it
        b"PONG",
        None,
    ):
        assert stream_message(other) is None, other

"""The replies of the stream hub's pub/sub connections, read in batches and kept as Redis sends them.

redis-py's `PubSub.get_message` reads one reply per call, through its retry layer and health check, and
makes a dict of each; with a thousand open streams that is a good part of an ingress's CPU. A hub reader
instead waits for one reply, then takes every other reply the connection has already received, without
waiting, and routes them as the lists they are: `[b"message", channel, data]`, `[b"smessage", ...]`,
`[b"subscribe", channel, count]`, `[b"sunsubscribe", ...]`, and `[b"pong", data]` for a PING.

Nothing here retries: the hub reconnects by itself (a reconnect must tell every stream to catch up), so a
lost connection raises RedisError or OSError to it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, cast

from hiredis import PushNotification
from redis._parsers import _AsyncHiredisParser
from redis._parsers.hiredis import NOT_ENOUGH_DATA
from redis.asyncio.client import PubSub
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError

MESSAGES = (b"message", b"smessage")
SUBSCRIBED = (b"subscribe", b"ssubscribe")
UNSUBSCRIBED = (b"unsubscribe", b"sunsubscribe")
NAMES_A_CHANNEL = (*MESSAGES, *SUBSCRIBED, *UNSUBSCRIBED)


def reply_kind(reply: object) -> bytes | None:
    """What a pub/sub reply is (`b"message"`, `b"subscribe"`, `b"pong"`...); None for a reply that is
    no list (a bare PONG) or names no kind. Pure."""
    if isinstance(reply, list) and reply and isinstance(reply[0], bytes):
        return reply[0]
    return None


def channel_of(reply: object) -> bytes | None:
    """The channel a pub/sub reply names, if it names one (a pong names none). Pure."""
    if reply_kind(reply) in NAMES_A_CHANNEL:
        assert isinstance(reply, list)
        if len(reply) > 1 and isinstance(reply[1], bytes):
            return reply[1]
    return None


def stream_message(reply: object) -> tuple[bytes, bytes] | None:
    """A published message's channel and payload, if `reply` is one (MESSAGE or SMESSAGE as Redis
    sends it); anything else is None. Pure."""
    if type(reply) is list and len(reply) == 3 and reply[0] in MESSAGES:
        channel, data = reply[1], reply[2]
        if type(channel) is bytes and type(data) is bytes:
            return channel, data
    return None


async def forget_unsubscribed(pubsub: PubSub, reply: object) -> None:
    """Let redis-py see an unsubscribe confirmation, so it forgets the channel it was asked to drop (it
    would otherwise keep every channel ever subscribed, and subscribe them again on a reconnect of its
    own)."""
    await cast(Callable[[object], Awaitable[object]], pubsub.handle_message)(reply)


async def read_replies(pubsub: PubSub, wait_s: float) -> list[object]:
    """The replies the pub/sub connection holds for its reader: the first waited for up to `wait_s`
    seconds ([] if none came), then every one already received, taken without waiting. As redis-py's own
    reads do, a PING health check is sent first when one is due; its pong comes back as a reply.

    A closed or lost connection, or an error reply, raises RedisError or OSError."""
    conn = cast(AbstractConnection | None, pubsub.connection)
    if conn is None or not conn.is_connected:
        raise RedisConnectionError("the pub/sub connection is closed")
    await cast(Callable[[], Awaitable[None]], pubsub.check_health)()
    first = await conn.read_response(timeout=wait_s, disconnect_on_error=False, push_request=True)
    if first is None:
        return []
    replies = [first]
    parser = conn._parser
    if isinstance(parser, _AsyncHiredisParser):
        await _take_parsed(parser, replies)
    # Another parser (hiredis is a dependency, so only where it was swapped out) gives one reply a call.
    return replies


async def _take_parsed(parser: _AsyncHiredisParser, replies: list[object]) -> None:
    """Append every reply the parser holds whole, as its `read_response` would give them one by one; what
    it holds of a reply not yet whole stays for the next read."""
    reader = cast(Any, parser)._reader
    handle_push = cast(Callable[[object], Awaitable[object]], parser.handle_push_response)
    while (reply := reader.gets()) is not NOT_ENOUGH_DATA:
        if isinstance(reply, PushNotification):  # RESP3: a message arrives as a push
            reply = await handle_push(reply)
            if reply is None:  # a push for redis-py itself (an invalidation, a maintenance notice)
                continue
        if isinstance(reply, Exception):  # an error reply: read_response raises it
            raise reply
        replies.append(reply)

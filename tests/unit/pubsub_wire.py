"""A pub/sub connection of redis-py's, with its own hiredis parser, fed by a test through a stream reader
in place of a socket."""

from __future__ import annotations

import asyncio

from redis._parsers import _AsyncHiredisParser
from redis.asyncio.client import PubSub
from redis.asyncio.connection import Connection, ConnectionPool


class Written:
    """The writing half of a connection: what redis-py sends is kept."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def writelines(self, data: list[bytes]) -> None:
        self.sent.extend(data)

    async def drain(self) -> None:
        return None

    @property
    def transport(self) -> Written:
        return self

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        return None


def bulk(*parts: bytes | int) -> bytes:
    """One RESP2 array of bulk strings and integers, as Redis sends a pub/sub reply."""
    out = b"*%d\r\n" % len(parts)
    for part in parts:
        out += b":%d\r\n" % part if isinstance(part, int) else b"$%d\r\n%s\r\n" % (len(part), part)
    return out


def connected_pubsub(
    received: asyncio.StreamReader, health_check_s: float = 0
) -> tuple[PubSub, Connection, Written]:
    conn = Connection(health_check_interval=health_check_s)
    written = Written()
    conn._reader = received
    conn._writer = written  # type: ignore[assignment]
    parser = conn._parser
    assert isinstance(parser, _AsyncHiredisParser)  # the parser the batches are taken from
    parser.on_connect(conn)  # type: ignore[no-untyped-call]
    pubsub = PubSub(ConnectionPool())
    pubsub.connection = conn  # type: ignore[assignment]
    return pubsub, conn, written

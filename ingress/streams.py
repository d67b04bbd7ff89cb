"""One Redis pub/sub connection per ingress process, fanned out to per-request subscriptions.

A subscription is confirmed by Redis before `subscribe` returns, so a request is produced to Kafka only
once its reply channel is live. If the connection drops, the open subscriptions wait: the hub reconnects
with backoff, subscribes to their channels again, and hands each one RESYNC, so its reader fills what it
missed from the request's replay log (queue_schemas.replay). A hub that cannot reconnect within
`outage_s` gives every open subscription HubDisconnected, and those requests end with an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import redis.asyncio as aioredis
import structlog
from redis.asyncio.client import PubSub
from redis.exceptions import RedisError

log = structlog.get_logger("sluice.ingress.streams")

SUBSCRIBE_TIMEOUT_S = 5.0
RESYNC = b""  # handed to a subscription after a reconnect: chunks may have been missed (never a payload)


class HubDisconnected(Exception):
    """The pub/sub connection was lost while the subscription was open."""


class Subscription:
    def __init__(self, hub: StreamHub, channel: bytes) -> None:
        self.channel = channel
        self._hub = hub
        self._queue: asyncio.Queue[bytes | BaseException] = asyncio.Queue()
        self.closed = False

    def deliver(self, item: bytes | BaseException) -> None:
        self._queue.put_nowait(item)

    async def next(self, within_s: float) -> bytes:
        """The next message, or TimeoutError after `within_s` seconds, or the hub's failure."""
        item = await asyncio.wait_for(self._queue.get(), within_s)
        if isinstance(item, BaseException):
            raise item
        return item

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            await self._hub.unsubscribe(self)


class StreamHub:
    def __init__(self, redis: aioredis.Redis, control_channel: str, outage_s: float = 30.0) -> None:
        self._redis = redis
        self._outage_s = outage_s
        self._control = control_channel.encode()
        self._pubsub: PubSub | None = None
        self._subs: dict[bytes, Subscription] = {}
        self._confirm: dict[bytes, asyncio.Future[None]] = {}
        self._lock = asyncio.Lock()
        self._reader: asyncio.Task[None] | None = None
        self._connected = asyncio.Event()

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    @property
    def open_subscriptions(self) -> int:
        return len(self._subs)

    async def start(self) -> None:
        self._reader = asyncio.create_task(self._run(), name="stream-hub")

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        if self._pubsub is not None:
            await self._pubsub.aclose()  # type: ignore[no-untyped-call]

    async def subscribe(self, channel: str) -> Subscription:
        if not self._connected.is_set():
            raise HubDisconnected("pub/sub connection is down")
        key = channel.encode()
        sub = Subscription(self, key)
        confirmed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._subs[key] = sub
        self._confirm[key] = confirmed
        try:
            async with self._lock:
                assert self._pubsub is not None
                await self._pubsub.subscribe(key)
            await asyncio.wait_for(confirmed, SUBSCRIBE_TIMEOUT_S)
        except (RedisError, OSError, TimeoutError) as exc:
            self._subs.pop(key, None)
            raise HubDisconnected(f"could not subscribe: {exc}") from exc
        finally:
            self._confirm.pop(key, None)
        return sub

    async def unsubscribe(self, sub: Subscription) -> None:
        if self._subs.get(sub.channel) is sub:
            del self._subs[sub.channel]
        if self._pubsub is None or not self._connected.is_set():
            return
        try:
            async with self._lock:
                await self._pubsub.unsubscribe(sub.channel)
        except (RedisError, OSError) as exc:
            log.warning("unsubscribe failed", error=str(exc))

    async def _run(self) -> None:
        delay = 0.1
        lost_at: float | None = None
        while True:
            try:
                await self._connect()
                if lost_at is not None:
                    log.info("pub/sub connection back", streams=len(self._subs))
                lost_at, delay = None, 0.1
                await self._read_forever()
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as exc:
                log.warning("pub/sub connection lost", error=str(exc))
            self._connected.clear()
            now = time.monotonic()
            lost_at = now if lost_at is None else lost_at
            if now - lost_at >= self._outage_s:
                self._fail_all(HubDisconnected("pub/sub connection lost; the stream may be incomplete"))
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def _connect(self) -> None:
        """Connect, subscribe to every open subscription's channel again, and tell each to catch up."""
        self._connected.clear()
        if self._pubsub is not None:
            with contextlib.suppress(RedisError, OSError):
                await self._pubsub.aclose()  # type: ignore[no-untyped-call]
        self._pubsub = self._redis.pubsub()
        # The control channel keeps the connection subscribed even when no request is open.
        await self._pubsub.subscribe(self._control, *self._subs)
        # Each confirmation arrives after the server has subscribed that channel, so a catch-up read
        # of the log that follows it misses nothing published later.
        pending = {self._control, *self._subs}
        while pending:
            msg = await self._pubsub.get_message(timeout=SUBSCRIBE_TIMEOUT_S)
            if msg is None:
                raise OSError("pub/sub subscriptions were not confirmed")
            if msg["type"] == "subscribe":
                pending.discard(msg["channel"])
            else:
                self._route(msg)
        self._connected.set()
        for sub in list(self._subs.values()):
            sub.deliver(RESYNC)

    async def _read_forever(self) -> None:
        assert self._pubsub is not None
        while True:
            msg = await self._pubsub.get_message(timeout=1.0)
            if msg is not None:
                self._route(msg)

    def _route(self, msg: dict[str, Any]) -> None:
        channel = msg["channel"]
        if msg["type"] == "subscribe":
            fut = self._confirm.get(channel)
            if fut is not None and not fut.done():
                fut.set_result(None)
        elif msg["type"] == "message":
            sub = self._subs.get(channel)
            if sub is not None:
                sub.deliver(msg["data"])

    def _fail_all(self, exc: BaseException) -> None:
        self._connected.clear()
        subs, self._subs = self._subs, {}
        for sub in subs.values():
            sub.deliver(exc)
        for fut in self._confirm.values():
            if not fut.done():
                fut.set_exception(exc)

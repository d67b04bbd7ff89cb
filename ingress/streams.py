"""Redis pub/sub connections of one ingress process, fanned out to per-request subscriptions.

On a single Redis server the hub holds one connection. On a Redis Cluster, streams use sharded pub/sub
(SSUBSCRIBE): a channel's messages are delivered only by the primary that owns its hash slot, so the
hub holds one connection per primary that owns a slot of an open stream, and routes each new
subscription to its slot's owner.

A channel may have several readers in one process (two clients reading one stored response's stream):
they share one subscription, which is dropped when the last of them closes.

A subscription is confirmed by Redis before `subscribe` returns, so a request is produced to Kafka only
once its reply channel is live. If a connection drops, the subscriptions on it wait: the hub
reconnects with backoff (on a cluster, after re-reading the slot map, so streams whose slots moved in a
failover or a resharding follow them to the new owner), subscribes to their channels again, and hands
each one RESYNC, so its reader fills what it missed from the request's replay log (plumbing.replay).
A cluster that moves a slot away tells its subscribers (SUNSUBSCRIBE without being asked): those
streams are re-homed the same way. A connection that cannot be restored within `outage_s` gives its
subscriptions HubDisconnected, and those requests end with an error.

A message the hub cannot route is dropped and its channel's readers catch up from the log; one that
cannot be handed to a subscription ends that subscription alone (HubDisconnected); either is counted
in `sluice_items_failed_total{loop="ingress.stream_hub"}`. A connection's reader outlives both, and
each reader is watched in the process's `Liveness` (/healthz).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable

import redis.asyncio as aioredis
import structlog
from redis.asyncio.client import PubSub
from redis.exceptions import RedisError

from ingress.pubsub_replies import (
    MESSAGES,
    SUBSCRIBED,
    UNSUBSCRIBED,
    channel_of,
    forget_unsubscribed,
    read_replies,
    reply_kind,
    stream_message,
)
from plumbing.clients import as_cluster
from plumbing.health import Liveness, item_failed
from plumbing.retry import doubling
from plumbing.tasks import stop_task

log = structlog.get_logger("sluice.ingress.streams")

SUBSCRIBE_TIMEOUT_S = 5.0
HUB_ITEMS = "ingress.stream_hub"  # the `loop` label of messages and subscriptions ended alone
# /healthz: a reader with no round for this long is stuck. A round takes a second while connected, a
# few while reconnecting, longer only while a cluster failover's streams are re-homed.
READER_STALE_S = 120.0
RESYNC = b""  # handed to a subscription after a reconnect: chunks may have been missed (never a payload)
SINGLE = "single"  # the one connection's name on a single server

NodeClient = Callable[[str, int], aioredis.Redis]


class HubDisconnected(Exception):
    """The pub/sub connection was lost while the subscription was open."""


def reader_name(shard: str) -> str:
    """A connection's reader, as its task and /healthz name it."""
    return f"stream-hub-{shard}"


class Subscription:
    """One reader's messages of a channel, in order, with one deadline for all of its waits.

    A relay waits on its subscription once per chunk, so a wait is a bare future (no queue of getters),
    and the deadline is one timer for the life of the stream, not one per wait."""

    def __init__(self, hub: StreamHub, channel: bytes) -> None:
        self.channel = channel
        self._hub = hub
        self._items: deque[bytes | BaseException] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._deadline: float | None = None  # wall-clock time the timer is for
        self._timer: asyncio.TimerHandle | None = None
        self.closed = False
        self.failed = False  # ended by the hub: nothing more is routed to it

    def deliver(self, item: bytes | BaseException) -> None:
        self._items.append(item)
        self._wake()

    def fail(self, exc: BaseException) -> None:
        """End this subscription alone: its reader gets `exc` next; its owner still closes it."""
        self.failed = True
        self._items.append(exc)
        self._wake()

    def ready(self) -> bool:
        """Whether a message (or the hub's failure) is waiting, so `next` returns without waiting."""
        return bool(self._items)

    async def next(self, deadline: float) -> bytes:
        """The next message; TimeoutError once the wall-clock `deadline` passes with none at hand; or the
        hub's failure; HubDisconnected once closed. A message at hand is returned whatever the time."""
        while not self._items:
            if self.closed:
                raise HubDisconnected("the subscription was closed")
            if time.time() >= deadline:
                raise TimeoutError
            self._arm(deadline)
            assert self._waiter is None, "a subscription has one reader"
            self._waiter = waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        if isinstance(item, BaseException):
            raise item
        return item

    def _arm(self, deadline: float) -> None:
        if self._timer is not None and self._deadline == deadline:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._deadline = deadline
        self._timer = asyncio.get_running_loop().call_later(max(0.0, deadline - time.time()), self._expire)

    def _expire(self) -> None:
        self._timer = None  # a timer that fires a little early is set again by the wait it wakes
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self.closed:
            self.closed = True
            self._wake()  # a reader still waiting ends now, not at its deadline
            await self._hub.unsubscribe(self)


class _Shard:
    """One pub/sub connection and the stream channels it carries."""

    def __init__(self, name: str, redis: aioredis.Redis) -> None:
        self.name = name
        self.redis = redis
        self.pubsub: PubSub | None = None
        self.channels: set[bytes] = set()
        self.lock = asyncio.Lock()
        self.connected = asyncio.Event()
        self.reader: asyncio.Task[None] | None = None
        self.retired = False  # no longer a primary that owns streams: its reader stops


class StreamHub:
    def __init__(
        self,
        redis: aioredis.Redis,
        control_channel: str,
        outage_s: float = 30.0,
        node_client: NodeClient | None = None,
        liveness: Liveness | None = None,
    ) -> None:
        self._redis = redis
        self.liveness = liveness or Liveness()
        self._cluster = as_cluster(redis)
        assert self._cluster is None or node_client is not None, "a cluster hub needs per-node clients"
        self._node_client = node_client
        self._outage_s = outage_s
        # How long a new subscription waits for its channel's primary: on a cluster, through a failover
        # (a replica takes the slots after the cluster's node timeout), as a stream waits out an outage.
        self._subscribe_wait_s = (
            SUBSCRIBE_TIMEOUT_S if self._cluster is None else max(SUBSCRIBE_TIMEOUT_S, outage_s)
        )
        self._control = control_channel.encode()
        self._subs: dict[bytes, list[Subscription]] = {}  # a channel may have several readers
        self._confirm: dict[bytes, asyncio.Future[None]] = {}
        self._shards: dict[str, _Shard] = {}
        self._shard_of: dict[bytes, str] = {}
        self._started = False

    @property
    def connected(self) -> bool:
        if not self._started:
            return False
        return all(s.connected.is_set() for s in self._shards.values() if not s.retired)

    @property
    def open_subscriptions(self) -> int:
        return sum(len(subs) for subs in self._subs.values())

    @property
    def shards(self) -> int:
        """Connections held now (one per cluster primary that owns an open stream's slot)."""
        return sum(1 for s in self._shards.values() if not s.retired)

    async def start(self) -> None:
        if self._cluster is None:
            self._open_shard(SINGLE, self._redis)
        else:
            await self._cluster.initialize()
        self._started = True

    async def wait_ready(self, within_s: float) -> None:
        """Until the hub can take subscriptions (a single server's connection is up); OSError if not
        within `within_s`."""
        give_up = time.monotonic() + within_s
        while not (self.connected or (self._started and self._cluster is not None)):
            if time.monotonic() > give_up:
                raise OSError("pub/sub connection did not come up")
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        for shard in list(self._shards.values()):
            await self._stop_shard(shard)

    async def subscribe(self, channel: str) -> Subscription:
        # On a cluster only the connection to this channel's primary matters (see _home).
        if not self._started or (self._cluster is None and not self.connected):
            raise HubDisconnected("pub/sub connection is down")
        key = channel.encode()
        sub = Subscription(self, key)
        readers = self._subs.get(key)
        if readers:  # already subscribed here (another reader of the same stream): share it
            readers.append(sub)
            await self._join(sub)
            return sub
        confirmed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._subs[key] = [sub]
        self._confirm[key] = confirmed
        give_up = time.monotonic() + self._subscribe_wait_s
        try:
            while True:
                shard = None
                try:
                    shard = await self._home(key)
                    async with shard.lock:
                        assert shard.pubsub is not None
                        await self._send_subscribe(shard.pubsub, key)
                    break
                except (RedisError, OSError):
                    # A connection that broke before its reader noticed; on a cluster, the slot's
                    # primary may be failing over: read the slot map again and retry.
                    if shard is not None:
                        shard.connected.clear()  # not chosen again until its reader reconnects
                    self._unassign(key)
                    if self._cluster is None or time.monotonic() >= give_up:
                        raise
                    await asyncio.sleep(0.2)
                    await self._read_slot_map()
            await asyncio.wait_for(confirmed, max(0.5, give_up - time.monotonic()))
        except (RedisError, OSError, TimeoutError) as exc:
            self._forget(key)
            if not confirmed.done():  # readers that joined meanwhile fail with this one
                confirmed.set_exception(HubDisconnected(f"could not subscribe: {exc}"))
                confirmed.exception()
            raise HubDisconnected(f"could not subscribe: {exc}") from exc
        except BaseException:  # abandoned (its handler was cancelled): readers that joined fail too
            self._forget(key)
            if not confirmed.done():
                confirmed.set_exception(HubDisconnected("the subscription was abandoned"))
                confirmed.exception()
            raise
        finally:
            self._confirm.pop(key, None)
        return sub

    async def _join(self, sub: Subscription) -> None:
        """A second reader of a channel: live once the first reader's subscription is confirmed."""
        pending = self._confirm.get(sub.channel)
        if pending is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(pending), self._subscribe_wait_s)
        except (HubDisconnected, TimeoutError) as exc:
            readers = self._subs.get(sub.channel)
            if readers is not None and sub in readers:
                readers.remove(sub)
            raise HubDisconnected(f"could not subscribe: {exc}") from exc

    async def unsubscribe(self, sub: Subscription) -> None:
        readers = self._subs.get(sub.channel)
        if not readers or sub not in readers:
            return
        readers.remove(sub)
        if readers:
            return  # the channel still has readers here
        shard = self._shards.get(self._shard_of.get(sub.channel, ""))
        self._forget(sub.channel)
        if shard is None or shard.pubsub is None or not shard.connected.is_set():
            return
        try:
            async with shard.lock:
                if self._cluster is not None:
                    await shard.pubsub.sunsubscribe(sub.channel)
                else:
                    await shard.pubsub.unsubscribe(sub.channel)
        except (RedisError, OSError) as exc:
            log.warning("unsubscribe failed", error=str(exc))

    # shards
    def _forget(self, key: bytes) -> None:
        self._subs.pop(key, None)
        self._unassign(key)

    def _unassign(self, key: bytes) -> None:
        name = self._shard_of.pop(key, None)
        if name in self._shards:
            self._shards[name].channels.discard(key)

    def _open_shard(self, name: str, redis: aioredis.Redis) -> _Shard:
        shard = _Shard(name, redis)
        self._shards[name] = shard
        shard.reader = asyncio.create_task(self._run(shard), name=reader_name(name))
        self.liveness.watch(reader_name(name), shard.reader, stale_after_s=READER_STALE_S)
        return shard

    async def _stop_shard(self, shard: _Shard) -> None:
        shard.retired = True
        shard.connected.clear()
        if self._shards.get(shard.name) is shard:
            self.liveness.forget(reader_name(shard.name))
        await stop_task(shard.reader)  # not the calling task: a reader stopping its own shard goes on
        with contextlib.suppress(RedisError, OSError):
            if shard.pubsub is not None:
                await shard.pubsub.aclose()
            if shard.redis is not self._redis:
                await shard.redis.aclose()

    async def _home(self, key: bytes) -> _Shard:
        """The connected shard that carries `key`, opened if needed; the channel is assigned to it. On a
        cluster whose primary for the slot is unreachable, the slot map is read again until a replica
        has taken over, for up to the hub's subscribe wait."""
        if self._cluster is None:
            shard = self._shards[SINGLE]
        else:
            give_up = time.monotonic() + self._subscribe_wait_s
            while True:
                shard = await self._shard_for(key)
                try:
                    await self._wait_connected(shard, min(1.0, max(0.0, give_up - time.monotonic())))
                    break
                except OSError:
                    if time.monotonic() >= give_up:
                        raise
                    await self._read_slot_map()
        shard.channels.add(key)
        self._shard_of[key] = shard.name
        return shard

    async def _read_slot_map(self) -> None:
        assert self._cluster is not None
        try:
            await self._cluster.nodes_manager.initialize()
        except Exception as exc:
            log.warning("slot map not read", error=repr(exc))

    async def _shard_for(self, key: bytes) -> _Shard:
        """The shard of the primary that owns `key`'s slot by the slot map as last read."""
        assert self._cluster is not None
        assert self._node_client is not None
        node = self._cluster.get_node_from_key(key.decode())
        if node is None:
            raise OSError("no node owns the channel's slot")
        found = self._shards.get(node.name)
        if found is None or found.retired:
            if found is not None:
                await self._stop_shard(found)
            found = self._open_shard(node.name, self._node_client(node.host, int(node.port)))
        return found

    async def _wait_connected(self, shard: _Shard, within_s: float) -> None:
        try:
            await asyncio.wait_for(shard.connected.wait(), within_s)
        except TimeoutError:
            raise OSError(f"pub/sub connection to {shard.name} is down") from None

    async def _rehome(self, keys: set[bytes]) -> None:
        """Move channels whose slots another primary owns now (after a failover or a slot move) to that
        primary's connection, each told to catch up from its log."""
        assert self._cluster is not None
        await self._read_slot_map()
        for key in keys:
            readers = self._subs.get(key)
            node = self._cluster.get_node_from_key(key.decode())
            if not readers or node is None or node.name == self._shard_of.get(key):
                continue  # still where it was: that connection's reconnect subscribes it again
            if key in self._confirm:
                continue  # still being subscribed: `subscribe` finds it a connection itself
            old = self._shards.get(self._shard_of.get(key, ""))
            if old is not None:
                old.channels.discard(key)
            try:
                shard = await self._home(key)
                async with shard.lock:
                    assert shard.pubsub is not None
                    await self._send_subscribe(shard.pubsub, key)
            except (RedisError, OSError) as exc:
                log.warning("stream not re-homed yet", error=str(exc))
                if old is not None:
                    old.channels.add(key)  # tried again when that connection is restored
                    self._shard_of[key] = old.name
                continue
            self._deliver(key, RESYNC)

    async def _send_subscribe(self, pubsub: PubSub, *keys: bytes) -> None:
        if self._cluster is not None:
            for key in keys:  # one slot per SSUBSCRIBE
                await pubsub.ssubscribe(key)
        elif keys:
            await pubsub.subscribe(*keys)

    # reading
    async def _run(self, shard: _Shard) -> None:
        delays = doubling(0.1, 1.0)
        lost_at: float | None = None
        while not shard.retired:
            self.liveness.beat(reader_name(shard.name))
            try:
                await self._connect(shard)
                if lost_at is not None:
                    log.info("pub/sub connection back", shard=shard.name, streams=len(shard.channels))
                lost_at, delays = None, doubling(0.1, 1.0)
                await self._read_forever(shard)
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as exc:
                log.warning("pub/sub connection lost", shard=shard.name, error=str(exc))
            except Exception as exc:  # the connection's state is unknown: start it over, as if lost
                log.error("pub/sub reader failed; reconnecting", shard=shard.name, exc_info=exc)
            shard.connected.clear()
            now = time.monotonic()
            lost_at = now if lost_at is None else lost_at
            if self._cluster is not None:
                if shard.channels:
                    await self._rehome(set(shard.channels))
                else:
                    await self._read_slot_map()
                if not shard.channels and not self._owns_slots(shard):
                    await self._stop_shard(shard)  # a primary that failed over: its streams moved
                    return
            if now - lost_at >= self._outage_s:
                self._fail(shard, HubDisconnected("pub/sub connection lost; the stream may be incomplete"))
            await asyncio.sleep(next(delays))

    def _owns_slots(self, shard: _Shard) -> bool:
        assert self._cluster is not None
        return any(node.name == shard.name for node in self._cluster.get_primaries())

    async def _connect(self, shard: _Shard) -> None:
        """Connect, subscribe to every channel of the shard again, and tell each to catch up."""
        shard.connected.clear()
        if shard.pubsub is not None:
            with contextlib.suppress(RedisError, OSError):
                await shard.pubsub.aclose()
        shard.pubsub = shard.redis.pubsub()
        channels = set(shard.channels)
        # The control channel keeps the connection subscribed even when no request is open.
        await shard.pubsub.subscribe(self._control)
        await self._send_subscribe(shard.pubsub, *channels)
        # Each confirmation arrives after the server has subscribed that channel, so a catch-up read
        # of the log that follows it misses nothing published later.
        pending = {self._control, *channels}
        while pending:
            replies = await read_replies(shard.pubsub, SUBSCRIBE_TIMEOUT_S)
            if not replies:
                raise OSError("pub/sub subscriptions were not confirmed")
            for reply in replies:
                if reply_kind(reply) in SUBSCRIBED and (channel := channel_of(reply)) is not None:
                    pending.discard(channel)
                await self._route_one(shard, reply)
        shard.connected.set()
        for key in channels:
            self._deliver(key, RESYNC)

    async def _read_forever(self, shard: _Shard) -> None:
        """Route what the connection receives, a batch per wake-up, beating at least once a second."""
        assert shard.pubsub is not None
        while True:
            self.liveness.beat(reader_name(shard.name))
            for reply in await read_replies(shard.pubsub, 1.0):
                if (message := stream_message(reply)) is not None:  # handed over without a coroutine
                    self._deliver(*message)
                else:
                    await self._route_one(shard, reply)

    async def _route_one(self, shard: _Shard, reply: object) -> None:
        """Route one reply (as Redis sent it); one that cannot be routed is dropped alone, and its
        channel's readers (if it names one) catch up from the log. A connection failure is raised to the
        reader."""
        try:
            await self._route(shard, reply)
        except (RedisError, OSError):
            raise
        except Exception as exc:
            item_failed(HUB_ITEMS)
            log.error("a pub/sub message could not be routed; dropped", shard=shard.name, exc_info=exc)
            channel = channel_of(reply)
            if channel is not None:
                self._deliver(channel, RESYNC)

    def _deliver(self, channel: bytes, data: bytes) -> None:
        """Hand a message to each reader of the channel; a reader it cannot be handed to ends alone."""
        for sub in self._subs.get(channel, ()):
            if sub.failed:
                continue
            try:
                sub.deliver(data)
            except Exception as exc:
                item_failed(HUB_ITEMS)
                log.error("a stream message could not be handed over; its reader ends", exc_info=exc)
                sub.fail(HubDisconnected("the stream could not be delivered"))

    async def _route(self, shard: _Shard, reply: object) -> None:
        if not isinstance(reply, list) or not reply:
            return  # a bare PONG
        kind = reply[0]
        if kind in MESSAGES:
            self._deliver(reply[1], reply[2])
        elif kind in SUBSCRIBED:
            fut = self._confirm.get(reply[1])
            if fut is not None and not fut.done():
                fut.set_result(None)
        elif kind in UNSUBSCRIBED:
            assert shard.pubsub is not None
            await forget_unsubscribed(shard.pubsub, reply)
            channel = reply[1]
            if kind == b"sunsubscribe" and channel in self._subs and channel in shard.channels:
                # Not asked for: the channel's slot moved to another primary.
                log.info("stream slot moved; following it", shard=shard.name)
                await self._rehome({channel})

    def _fail(self, shard: _Shard, exc: BaseException) -> None:
        for key in list(shard.channels):
            readers = self._subs.get(key, [])
            self._forget(key)
            for sub in readers:
                sub.fail(exc)
            fut = self._confirm.get(key)
            if fut is not None and not fut.done():
                fut.set_exception(exc)

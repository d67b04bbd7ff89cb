"""Reading the workers' live state from Redis, the same way in every service that needs it."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from plumbing.clients import mget_any
from plumbing.health import item_failed
from queue_schemas.codec import decode, encode
from queue_schemas.errors import SchemaError
from queue_schemas.messages import Heartbeat, WorkerState
from queue_schemas.names import Names

log = structlog.get_logger("sluice.state")

CLOSE_TIMEOUT_S = 1.0


async def publish_heartbeat(redis: aioredis.Redis, names: Names, hb: Heartbeat) -> None:
    """Refresh a worker's heartbeat key (with its TTL), its pool membership, and push it to dispatchers."""
    payload = encode(hb)
    async with redis.pipeline(transaction=False) as pipe:
        pipe.set(names.heartbeat(hb.pool, hb.worker_id), payload, px=hb.ttl_ms)
        pipe.sadd(names.workers(hb.pool), hb.worker_id)
        pipe.execute_command("PUBLISH", names.heartbeat_channel(hb.pool), payload)  # see publisher.py
        await pipe.execute()


async def read_heartbeats(
    redis: aioredis.Redis, names: Names, pool: str
) -> tuple[list[Heartbeat], list[str]]:
    """The live heartbeats of a pool's workers, and the members that are gone: heartbeat expired, or
    failed (a failed worker's last heartbeat stays readable, but it serves nothing any more).

    Gone workers stay in the set: the dispatcher that recovers their inbox removes them.
    """
    members = await redis.smembers(names.workers(pool))
    ids = sorted(m.decode() if isinstance(m, bytes) else m for m in members)
    if not ids:
        return [], []
    raws = await mget_any(redis, [names.heartbeat(pool, w) for w in ids])
    beats = []
    gone = []
    for worker_id, raw in zip(ids, raws, strict=True):
        if raw is None:
            gone.append(worker_id)
            continue
        try:
            hb = decode(Heartbeat, raw)
        except SchemaError as exc:
            log.warning("ignoring bad heartbeat", worker=worker_id, reason=str(exc))
            continue
        beats.append(hb)
        if hb.state is WorkerState.FAILED:
            gone.append(worker_id)
    return beats, gone


async def follow_channel(
    redis: aioredis.Redis, channel: str, on_message: Callable[[bytes], Awaitable[None] | None]
) -> None:
    """Call `on_message` with every message published on `channel`, resubscribing after connection loss.

    Runs until cancelled. Pub/sub delivers only while subscribed, so callers that must not miss state
    also re-read it from its keys.
    """
    while True:
        pubsub = redis.pubsub()
        try:
            await pubsub.subscribe(channel)
            async for msg in pubsub.listen():
                if msg["type"] == "message":
                    await _handle_one(channel, on_message, msg["data"])
        except (RedisError, OSError) as exc:
            log.warning("channel lost; resubscribing", channel=channel, error=str(exc))
            await asyncio.sleep(0.5)
        finally:
            # Bounded: closing talks to Redis, and a service stopping (this task cancelled) must not
            # wait on a connection that does not answer.
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(pubsub.aclose(), CLOSE_TIMEOUT_S)


async def _handle_one(
    channel: str, on_message: Callable[[bytes], Awaitable[None] | None], data: bytes
) -> None:
    """One message: a handler that raises (other than on a Redis error) ends that message alone."""
    try:
        result = on_message(data)
        if inspect.isawaitable(result):
            await result
    except (RedisError, OSError):
        raise
    except Exception as exc:
        item_failed("follow_channel")
        log.error(
            "a channel message failed; skipped", channel=channel, error=type(exc).__name__, exc_info=exc
        )

"""How every service builds its bus clients from BusSettings, so they all agree on timeouts and limits.

Construction only: nothing here connects until the caller starts the client.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar, cast

import redis.asyncio as aioredis
import structlog
from aiokafka.helpers import create_ssl_context
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.exceptions import ClusterDownError, SlotNotCoveredError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from plumbing import tracing
from plumbing.retry import doubling
from queue_schemas.settings import BusSettings

T = TypeVar("T")
log = structlog.get_logger("sluice.clients")
REDIS_RETRIES = 3
CLUSTER_FAILOVER_S = 10.0  # how long a cluster command waits for a lost primary's replica to take over


def redis_client(settings: BusSettings, *, retry: bool = True) -> aioredis.Redis:
    """A client whose pool waits (up to 5 s) for a free connection instead of failing at the cap; with
    `redis_cluster`, a cluster client that routes each command to its slot's node.

    The cluster client speaks the same command API (redis-py's RedisCluster), so every caller is typed
    against `Redis`; what differs (multi-slot reads, stream subscriptions) goes through the helpers below.

    With `retry`, a command that meets a broken connection (pooled connections all break when the server
    restarts) is sent again on a fresh one, up to REDIS_RETRIES times over about a second. A pub/sub
    reader that must notice a lost connection, because messages published meanwhile are gone, takes
    retry=False: its subscription would otherwise be renewed silently.
    """
    options = redis_security(settings)
    if settings.redis_cluster:
        return _cluster_client(settings, options, retry)
    if retry:
        options["retry"] = Retry(ExponentialBackoff(cap=0.5, base=0.05), REDIS_RETRIES)
        options["retry_on_error"] = [RedisConnectionError, RedisTimeoutError]
    pool = aioredis.BlockingConnectionPool.from_url(
        settings.redis_url,
        max_connections=settings.redis_max_connections,
        timeout=5.0,
        socket_connect_timeout=2.0,
        health_check_interval=15,
        **options,
    )
    return aioredis.Redis.from_pool(pool)  # owns the pool: aclose() closes its connections


class FailoverTolerantCluster(RedisCluster):
    """A cluster client that rides out a failover: a command whose node is gone is sent again, with
    backoff, for up to `failover_s` while the cluster promotes a replica (about two node timeouts).
    redis-py's own retries re-read the slot map but do not wait, so alone they are spent before the
    replica has taken over."""

    failover_s = 0.0

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        give_up = time.monotonic() + self.failover_s
        delays = doubling(0.05, 1.0)
        while True:
            try:
                return await super().execute_command(*args, **kwargs)
            except (RedisConnectionError, RedisTimeoutError, ClusterDownError, SlotNotCoveredError) as exc:
                error: Exception = exc
            except AttributeError as exc:
                # redis-py can meet a connection its failure handling closed under it (its writer is
                # gone); that is the same lost node, not a fault of the command.
                if "NoneType" not in str(exc):
                    raise
                error = RedisConnectionError(f"connection closed during a failover: {exc}")
            delay = next(delays)
            if time.monotonic() + delay > give_up:
                raise error
            await asyncio.sleep(delay)


def _cluster_client(settings: BusSettings, options: dict[str, Any], retry: bool) -> aioredis.Redis:
    cluster = FailoverTolerantCluster.from_url(
        settings.redis_url,
        max_connections=settings.redis_max_connections,
        socket_connect_timeout=2.0,
        health_check_interval=15,
        retry=Retry(NoBackoff(), REDIS_RETRIES if retry else 0),
        **options,
    )
    assert isinstance(cluster, FailoverTolerantCluster)
    cluster.failover_s = CLUSTER_FAILOVER_S if retry else 0.0
    return cast(aioredis.Redis, cluster)


def sync_redis_client(settings: BusSettings) -> Any:
    """A blocking client (redis-py's Redis, or RedisCluster), for a worker thread that is not on the event
    loop (the tracing timeline's exporter)."""
    import redis as sync_redis
    from redis.cluster import RedisCluster as SyncCluster

    options = redis_security(settings)
    if settings.redis_cluster:
        return SyncCluster.from_url(
            settings.redis_url, socket_connect_timeout=2.0, socket_timeout=5.0, **options
        )
    return sync_redis.Redis.from_url(
        settings.redis_url, socket_connect_timeout=2.0, socket_timeout=5.0, **options
    )


def node_client(settings: BusSettings, host: str, port: int) -> aioredis.Redis:
    """A plain client of one cluster node (a pub/sub connection to the primary that owns a slot), with
    the cluster's credentials and TLS; no retries, like every pub/sub reader's."""
    options = redis_security(settings)
    if settings.redis_url.startswith("rediss://"):
        options["ssl"] = True
    return aioredis.Redis(
        host=host,
        port=port,
        socket_connect_timeout=2.0,
        health_check_interval=15,
        # No reconnecting inside a read: the hub must learn at once that a node is gone, to follow
        # its slots to the replica that takes over.
        retry=Retry(NoBackoff(), 0),
        **options,
    )


def as_cluster(redis: aioredis.Redis) -> RedisCluster | None:
    """The cluster client behind `redis`, or None for a single server."""
    client: object = redis
    return client if isinstance(client, RedisCluster) else None


async def mget_any(redis: aioredis.Redis, keys: Sequence[str]) -> list[Any]:
    """MGET of keys that may live in different slots (one MGET per slot on a cluster)."""
    if not keys:
        return []
    cluster = as_cluster(redis)
    if cluster is not None:
        return list(await cluster.mget_nonatomic(list(keys)))
    return list(await redis.mget(list(keys)))


async def xread_any(redis: aioredis.Redis, streams: dict[str, str], count: int, block_ms: int) -> list[Any]:
    """New entries of several streams, as [(stream, entries)]. A cluster reads each slot's streams
    without blocking (one blocking read per node would hold a connection each), then waits `block_ms`
    when nothing was new; a single server takes one blocking XREAD."""
    wanted: Any = streams
    cluster = as_cluster(redis)
    if cluster is None:
        return stream_items(await redis.xread(wanted, count=count, block=block_ms))
    by_slot: dict[int, dict[Any, Any]] = {}
    for stream, cursor in streams.items():
        by_slot.setdefault(cluster.keyslot(stream), {})[stream] = cursor
    replies = await asyncio.gather(*(cluster.xread(group, count=count) for group in by_slot.values()))
    items = [item for reply in replies for item in stream_items(reply)]
    if not items:
        await asyncio.sleep(block_ms / 1000)
    return items


def stream_items(reply: Any) -> list[tuple[Any, Any]]:
    """XREAD's reply as [(stream, entries)], whether it came as RESP2 lists or a RESP3 map."""
    if not reply:
        return []
    return list(reply.items()) if isinstance(reply, dict) else [(item[0], item[1]) for item in reply]


def redis_security(settings: BusSettings) -> dict[str, Any]:
    """Connection options for AUTH and TLS beyond what the URL says (rediss:// turns TLS on)."""
    options: dict[str, Any] = {}
    if settings.redis_password is not None:
        options["password"] = settings.redis_password.get_secret_value()
    if settings.redis_username is not None:
        options["username"] = settings.redis_username
    if settings.redis_ssl_ca_certs is not None:
        options["ssl_ca_certs"] = str(settings.redis_ssl_ca_certs)
    if settings.redis_ssl_certfile is not None and settings.redis_ssl_keyfile is not None:
        options["ssl_certfile"] = str(settings.redis_ssl_certfile)
        options["ssl_keyfile"] = str(settings.redis_ssl_keyfile)
    return options


def kafka_security(settings: BusSettings) -> dict[str, Any]:
    """Options every Kafka client (producer, consumer, admin) takes for TLS and SASL."""
    protocol = settings.kafka_security_protocol
    options: dict[str, Any] = {"bootstrap_servers": settings.kafka_bootstrap, "security_protocol": protocol}
    if protocol in ("SSL", "SASL_SSL"):
        options["ssl_context"] = create_ssl_context(
            cafile=settings.kafka_ssl_cafile,
            certfile=settings.kafka_ssl_certfile,
            keyfile=settings.kafka_ssl_keyfile,
        )
    if protocol.startswith("SASL"):
        assert settings.kafka_sasl_password is not None  # BusSettings checks the pair
        options["sasl_mechanism"] = settings.kafka_sasl_mechanism
        options["sasl_plain_username"] = settings.kafka_sasl_username
        options["sasl_plain_password"] = settings.kafka_sasl_password.get_secret_value()
    return options


def admin_options(settings: BusSettings) -> dict[str, Any]:
    return {**kafka_security(settings), "request_timeout_ms": settings.kafka_request_timeout_ms}


def producer_options(settings: BusSettings) -> dict[str, Any]:
    # Tansu cannot do InitProducerId, so no idempotent producer: consumers de-duplicate by request id.
    return {
        **kafka_security(settings),
        "acks": "all",
        "enable_idempotence": False,
        "linger_ms": 0,
        "request_timeout_ms": settings.kafka_request_timeout_ms,
    }


def consumer_options(settings: BusSettings, group_id: str | None) -> dict[str, Any]:
    return {
        **kafka_security(settings),
        "group_id": group_id,
        "enable_auto_commit": False,
        "auto_offset_reset": "earliest",
        "fetch_max_wait_ms": settings.kafka_fetch_wait_ms,
        "session_timeout_ms": settings.kafka_session_timeout_ms,
        "heartbeat_interval_ms": settings.kafka_heartbeat_interval_ms,
        "request_timeout_ms": max(
            settings.kafka_request_timeout_ms, settings.kafka_session_timeout_ms + 5000
        ),
    }


class BusUnavailable(RuntimeError):
    """The broker or Redis could not be reached at start-up, after every retry."""


async def with_backoff(
    action: Callable[[], Awaitable[T]],
    what: str,
    *,
    attempts: int = 30,
    first_delay: float = 0.1,
    max_delay: float = 2.0,
) -> T:
    """Run `action` until it succeeds, sleeping with jittered exponential backoff between failures.

    Raises BusUnavailable, naming `what` and the last error, when every attempt failed.
    """
    delays = doubling(first_delay, max_delay)
    for attempt in range(1, attempts + 1):
        try:
            return await action()
        except Exception as exc:
            reason = str(exc) or type(exc).__name__
            if attempt == attempts:
                raise BusUnavailable(f"{what} failed {attempts} times; last error: {reason}") from exc
            log.warning("retrying", what=what, attempt=attempt, error=reason)
            await asyncio.sleep(next(delays) * (0.5 + random.random()))
    raise AssertionError("unreachable")


def configure_logging(settings: BusSettings, service: str) -> None:
    """structlog to stderr, key=value for people or JSON lines for collectors.

    Tracebacks are plain in both modes: frames and lines, never local variables, which would carry
    prompts, request bodies and keys into the logs."""
    level = getattr(logging, settings.log_level.upper())
    logging.basicConfig(level=level, format="%(message)s")
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if settings.log_json
        else structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            tracing.add_trace_id,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            *([structlog.processors.format_exc_info] if settings.log_json else []),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)
    tracing.configure(settings, service)

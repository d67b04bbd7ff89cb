"""The scaler's loop: read offsets from the broker each tick, compute lag, export it."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis
import structlog
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from prometheus_client import Gauge
from redis.exceptions import RedisError

from queue_schemas.codec import encode
from queue_schemas.messages import PoolState
from queue_schemas.names import Names
from queue_schemas.state import read_heartbeats
from scaler.lag import PoolLag, pool_lag, pool_state

log = structlog.get_logger("sluice.scaler")

PARTITION_LAG = Gauge("sluice_consumer_lag", "Dispatcher-group lag per partition", ["pool", "partition"])
POOL_LAG = Gauge("sluice_pool_lag", "Dispatcher-group lag summed over a pool's partitions", ["pool"])
LAG_READ_AT = Gauge("sluice_lag_read_timestamp_seconds", "When the pool's lag was last read", ["pool"])


class LagReader:
    def __init__(self, admin: AIOKafkaAdminClient, consumer: AIOKafkaConsumer, names: Names) -> None:
        self._admin = admin
        self._consumer = consumer
        self.names = names

    async def read(self, pool: str) -> PoolLag:
        topic = self.names.requests_topic(pool)
        group = self.names.dispatcher_group(pool)
        partitions = await self._partitions(topic)
        tps = [TopicPartition(topic, p) for p in partitions]
        if not tps:
            return pool_lag(pool, topic, group, {}, {}, {}, time.time())
        ends = await self._consumer.end_offsets(tps)
        starts = await self._consumer.beginning_offsets(tps)
        # Passing the partitions explicitly is required by the dev broker and harmless on Kafka.
        offsets = await self._admin.list_consumer_group_offsets(group, partitions=tps)
        committed = {
            tp.partition: (meta.offset if meta is not None else None) for tp, meta in offsets.items()
        }
        return pool_lag(
            pool,
            topic,
            group,
            {tp.partition: off for tp, off in ends.items()},
            committed,
            {tp.partition: off for tp, off in starts.items()},
            time.time(),
        )

    async def _partitions(self, topic: str) -> list[int]:
        described = await self._admin.describe_topics([topic])
        for entry in described:
            if entry.get("topic") == topic and not entry.get("error_code"):
                return sorted(int(p["partition"]) for p in entry.get("partitions", []))
        return []


def export(lag: PoolLag) -> None:
    for partition, value in lag.partitions.items():
        PARTITION_LAG.labels(lag.pool, str(partition)).set(value)
    POOL_LAG.labels(lag.pool).set(lag.total)
    LAG_READ_AT.labels(lag.pool).set(lag.read_at)


async def publish_state(redis: aioredis.Redis, names: Names, lag: PoolLag, ttl_s: float) -> PoolState:
    beats, _ = await read_heartbeats(redis, names, lag.pool)
    state = pool_state(lag, beats, time.time())
    await redis.set(names.pool_state(lag.pool), encode(state), px=int(ttl_s * 1000))
    return state


async def lag_loop(
    reader: LagReader,
    redis: aioredis.Redis,
    pools: list[str],
    tick_s: float,
    latest: dict[str, PoolLag],
) -> None:
    """Each tick: read every pool's lag, export it, and publish the pool state admission control reads."""
    while True:
        for pool in pools:
            try:
                lag = await reader.read(pool)
                latest[pool] = lag
                export(lag)
                await publish_state(redis, reader.names, lag, ttl_s=3 * tick_s)
            except (KafkaError, RedisError) as exc:
                log.warning("pool read failed", pool=pool, error=str(exc))
        await asyncio.sleep(tick_s)

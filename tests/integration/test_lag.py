"""Lag read from the real broker: end offsets minus the dispatcher group's commits."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from plumbing.clients import consumer_options, producer_options, redis_client
from queue_schemas.settings import BusSettings
from scaler.service import LagReader
from tests.conftest import Bus
from tests.integration.helpers import create_topics, lag_reader

pytestmark = pytest.mark.timeout(60)


@contextlib.asynccontextmanager
async def clients(settings: BusSettings) -> AsyncIterator[tuple[AIOKafkaProducer, LagReader]]:
    """A producer and a lag reader, started and stopped together."""
    producer = AIOKafkaProducer(**producer_options(settings))
    await producer.start()
    try:
        async with lag_reader(settings) as reader:
            yield producer, reader
    finally:
        await producer.stop()


async def commit(settings: BusSettings, topic: str, partition: int, offset: int) -> None:
    group = AIOKafkaConsumer(**consumer_options(settings, settings.names.dispatcher_group("sim")))
    await group.start()
    try:
        group.assign([TopicPartition(topic, partition)])
        await group.commit({TopicPartition(topic, partition): offset})
    finally:
        await group.stop()


async def test_lag_counts_uncommitted_messages_per_partition(bus: Bus) -> None:
    settings = bus.settings()
    topic = settings.names.requests_topic("sim")
    await create_topics(settings, topic, partitions=2)
    async with clients(settings) as (producer, reader):
        for i in range(5):
            await producer.send_and_wait(topic, b"x", partition=0, key=str(i).encode())
        for i in range(2):
            await producer.send_and_wait(topic, b"y", partition=1, key=str(i).encode())

        before = await reader.read("sim")
        assert dict(before.partitions) == {0: 5, 1: 2}

        await commit(settings, topic, 0, 3)
        after = await reader.read("sim")
        assert dict(after.partitions) == {0: 2, 1: 2}
        assert after.total == 4


async def test_reported_high_watermark_corrects_a_short_listed_end_offset(bus: Bus) -> None:
    """Batched produce can make the dev broker's ListOffsets undercount; fetch high watermarks do not."""
    settings = bus.settings()
    names = settings.names
    topic = names.requests_topic("sim")
    await create_topics(settings, topic, partitions=1)
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap, linger_ms=50)
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    reader_consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap)
    fetcher = AIOKafkaConsumer(
        topic, bootstrap_servers=settings.kafka_bootstrap, auto_offset_reset="earliest"
    )
    redis = redis_client(settings)
    for client in (producer, admin, reader_consumer, fetcher):
        await client.start()
    try:
        sends = [await producer.send(topic, b"x", partition=0) for _ in range(8)]  # one batch of 8
        await asyncio.gather(*sends)
        records = await fetcher.getmany(timeout_ms=3000)
        assert sum(len(r) for r in records.values()) == 8
        mark = fetcher.highwater(TopicPartition(topic, 0))
        assert mark == 8

        reader = LagReader(admin, reader_consumer, names, redis)
        listed = await reader.read("sim")
        await redis.hset(names.highwater("sim"), mapping={"0": mark})
        corrected = await reader.read("sim")
        assert corrected.partitions[0] == 8, "nothing committed: all 8 records are lag"
        assert listed.partitions[0] <= 8
        print(
            f"lag from the listed end offset {listed.partitions[0]}, with the mark {corrected.partitions[0]}"
        )
    finally:
        for client in (producer, admin, reader_consumer, fetcher):
            await (client.close() if isinstance(client, AIOKafkaAdminClient) else client.stop())
        await redis.aclose()


async def test_batch_lag_is_read_from_the_batch_topic_with_the_same_group(bus: Bus) -> None:
    settings = bus.settings()
    requests, batch = settings.names.requests_topic("sim"), settings.names.batch_topic("sim")
    await create_topics(settings, requests, partitions=1)
    await create_topics(settings, batch, partitions=1)
    async with clients(settings) as (producer, reader):
        for i in range(4):
            await producer.send_and_wait(batch, b"b", partition=0, key=str(i).encode())
        await producer.send_and_wait(requests, b"r", partition=0, key=b"r")
        await commit(settings, batch, 0, 1)
        assert dict((await reader.read("sim", batch=True)).partitions) == {0: 3}
        assert dict((await reader.read("sim")).partitions) == {0: 1}, "the interactive topic is apart"

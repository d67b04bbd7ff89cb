"""Lag read from the real broker: end offsets minus the dispatcher group's commits."""

from __future__ import annotations

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from queue_schemas.clients import consumer_options, producer_options
from scaler.service import LagReader
from tests.conftest import Bus
from tests.integration.helpers import create_topics

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


async def test_lag_counts_uncommitted_messages_per_partition(bus: Bus) -> None:
    settings = bus.settings()
    names = settings.names
    topic = names.requests_topic("sim")
    await create_topics(settings, topic, partitions=2)
    producer = AIOKafkaProducer(**producer_options(settings))
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    reader_consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap)
    await producer.start()
    await admin.start()
    await reader_consumer.start()
    try:
        for i in range(5):
            await producer.send_and_wait(topic, b"x", partition=0, key=str(i).encode())
        for i in range(2):
            await producer.send_and_wait(topic, b"y", partition=1, key=str(i).encode())
        reader = LagReader(admin, reader_consumer, names)

        before = await reader.read("sim")
        assert dict(before.partitions) == {0: 5, 1: 2}

        group = AIOKafkaConsumer(**consumer_options(settings, names.dispatcher_group("sim")))
        await group.start()
        try:
            group.assign([TopicPartition(topic, 0)])
            await group.commit({TopicPartition(topic, 0): 3})
        finally:
            await group.stop()
        after = await reader.read("sim")
        assert dict(after.partitions) == {0: 2, 1: 2}
        assert after.total == 4
    finally:
        await reader_consumer.stop()
        await admin.close()
        await producer.stop()

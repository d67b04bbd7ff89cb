"""`sluice usage`: a team's usage from the `<prefix>.usage` topic, per day or per model.

The topic is read from its start up to the end offsets at the time of the call, without a consumer group
(nothing is committed, so it can be run any number of times)."""

from __future__ import annotations

import datetime as dt

import structlog
from aiokafka import AIOKafkaConsumer, TopicPartition

from plumbing.clients import consumer_options
from queue_schemas.settings import BusSettings
from queue_schemas.usage import UsageEvent

log = structlog.get_logger("sluice.usage")


async def read_usage(settings: BusSettings, idle_ms: int = 1000) -> list[UsageEvent]:
    """Every usage record on the topic now (a record that is not one is skipped and logged)."""
    topic = settings.names.usage_topic()
    consumer = AIOKafkaConsumer(**consumer_options(settings, None))
    await consumer.start()
    try:
        partitions = [TopicPartition(topic, p) for p in sorted(await _partitions(consumer, topic))]
        if not partitions:
            return []
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        ends = await consumer.end_offsets(partitions)
        events: list[UsageEvent] = []
        while await _behind(consumer, ends):
            batches = await consumer.getmany(*partitions, timeout_ms=idle_ms)
            for records in batches.values():
                for record in records:
                    try:
                        events.append(UsageEvent.model_validate_json(record.value or b""))
                    except ValueError:
                        log.warning("a record on the usage topic is not a usage event", offset=record.offset)
        return events
    finally:
        await consumer.stop()


async def _behind(consumer: AIOKafkaConsumer, ends: dict[TopicPartition, int]) -> bool:
    for partition, end in ends.items():
        if await consumer.position(partition) < end:
            return True
    return False


async def _partitions(consumer: AIOKafkaConsumer, topic: str) -> set[int]:
    found = consumer.partitions_for_topic(topic)
    if found is None:
        await consumer.topics()  # loads the cluster's metadata
        found = consumer.partitions_for_topic(topic)
    return set(found or ())


def parse_since(text: str, now: dt.datetime) -> float:
    """`2026-11-30`, an ISO time, or a span back from now (`7d`, `12h`) -> epoch seconds."""
    units = {"d": 86400, "h": 3600, "m": 60}
    if text[:-1].isdigit() and text[-1:] in units:
        return now.timestamp() - int(text[:-1]) * units[text[-1]]
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(
            f"--since {text!r}: give a date (2026-11-30), an ISO time or a span (7d, 12h)"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return when.timestamp()

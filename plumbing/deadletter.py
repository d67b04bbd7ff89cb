"""The dead letter for a record a consumer cannot use: where it came from, why, and its bytes (bounded)."""

from __future__ import annotations

import time
from typing import Any

from aiokafka import AIOKafkaProducer, ConsumerRecord
from aiokafka.errors import KafkaError

from queue_schemas.codec import encode
from queue_schemas.messages import DeadLetter

PAYLOAD_LIMIT = 64 * 1024
REASON_LIMIT = 1024


def dead_letter(record: ConsumerRecord[Any, Any], reason: str, consumer: str, now: float) -> DeadLetter:
    raw: bytes = record.value or b""
    return DeadLetter(
        source=record.topic,
        partition=record.partition,
        offset=record.offset,
        reason=reason if len(reason) <= REASON_LIMIT else reason[:REASON_LIMIT] + "...",
        payload=raw[:PAYLOAD_LIMIT].decode(errors="replace"),
        consumer=consumer,
        failed_at=now,
    )


async def send_dead_letter(
    producer: AIOKafkaProducer, topic: str, record: ConsumerRecord[Any, Any], reason: str, consumer: str
) -> None:
    """Produce `record`'s dead letter to `topic` and wait for the broker's acknowledgement. A letter the
    broker refuses for good (larger than it takes, say) goes again without its payload; the KafkaError
    of a second refusal is raised for the caller to log and go on."""
    letter = dead_letter(record, reason, consumer, time.time())
    try:
        await producer.send_and_wait(topic, encode(letter))
    except KafkaError as exc:
        if exc.retriable:
            raise
        await producer.send_and_wait(topic, encode(letter.model_copy(update={"payload": ""})))

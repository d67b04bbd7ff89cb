"""Dead letters stay bounded, and one the broker refuses for good never holds a record's offset open."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiokafka import ConsumerRecord
from aiokafka.errors import KafkaConnectionError, MessageSizeTooLargeError

from plumbing.deadletter import PAYLOAD_LIMIT, REASON_LIMIT, dead_letter, send_dead_letter


def record(value: bytes) -> ConsumerRecord[Any, Any]:
    return ConsumerRecord(
        topic="sluice.batch.p", partition=0, offset=7, timestamp=0, timestamp_type=0, key=None, value=value,
        checksum=None, serialized_key_size=0, serialized_value_size=len(value), headers=(),
    )  # fmt: skip


class Producer:
    """Takes sends until `refusals` runs out, raising each of its errors in turn first."""

    def __init__(self, *refusals: Exception) -> None:
        self.refusals = list(refusals)
        self.sent: list[dict[str, Any]] = []

    async def send_and_wait(self, topic: str, value: bytes) -> None:
        if self.refusals:
            raise self.refusals.pop(0)
        self.sent.append(json.loads(value))


def test_reason_and_payload_are_bounded() -> None:
    letter = dead_letter(record(b"x" * (PAYLOAD_LIMIT * 2)), "r" * 100_000, "c", 0.0)
    assert len(letter.payload) == PAYLOAD_LIMIT
    assert len(letter.reason) == REASON_LIMIT + 3


def test_a_letter_refused_for_good_goes_again_without_its_payload() -> None:
    producer = Producer(MessageSizeTooLargeError())
    asyncio.run(send_dead_letter(producer, "dl", record(b"body"), "why", "c"))
    assert [(sent["payload"], sent["reason"]) for sent in producer.sent] == [("", "why")]


def test_a_broker_that_is_away_is_raised_for_the_caller_to_retry() -> None:
    producer = Producer(KafkaConnectionError())
    with pytest.raises(KafkaConnectionError):
        asyncio.run(send_dead_letter(producer, "dl", record(b"body"), "why", "c"))
    assert producer.sent == []

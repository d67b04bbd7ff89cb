"""Delivering batch answers to reply topics, once per request, through one guarded path.

Whoever ends a batch request (the worker that served it, or the dispatcher that refused or timed it out)
delivers its answer through `AnswerSink`: a request already marked answered is skipped, the answer is
produced with acks=all, then the mark is set. A duplicate can reach the topic only if the deliverer dies
between the produce and the mark; answers carry the request id so readers can drop it (`sluice batch`
does).

An answer the reply topic will not take (unknown, refused, unauthorised, too large) goes to the dead-letter
topic with the reason and is marked answered, so no record can stop the service that answers it. Only when
the dead-letter topic cannot take it either (the broker itself is unreachable) does `deliver` raise
`BusUnavailable`: that is an outage, not a bad record, and the caller keeps the request for later.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from enum import Enum

import redis.asyncio as aioredis
import structlog
from aiokafka import AIOKafkaProducer

from plumbing.clients import BusUnavailable, with_backoff
from queue_schemas.batch import BatchAnswer
from queue_schemas.codec import encode
from queue_schemas.messages import DeadLetter
from queue_schemas.names import Names

log = structlog.get_logger("sluice.answers")

ANSWERED_TTL_S = 8 * 24 * 3600  # longer than the longest completion window
ANSWER_ATTEMPTS = 2


class Delivery(Enum):
    SENT = "sent"
    DUPLICATE = "duplicate"  # answered already
    DEAD_LETTERED = "dead_lettered"  # the reply topic would not take it


def undeliverable(topic: str, key: str, answer: BatchAnswer, reason: str, sender: str) -> DeadLetter:
    """The dead letter of an answer its reply topic refused: where it was going, why it did not arrive."""
    return DeadLetter(
        source=topic,
        reason=f"answer to {key} could not be delivered: {reason}",
        payload=encode(answer).decode(),
        consumer=sender,
        failed_at=time.time(),
    )


class AnswerSink:
    def __init__(
        self,
        redis: aioredis.Redis,
        names: Names,
        producer: Callable[[], AIOKafkaProducer],
        started: AIOKafkaProducer | None = None,
        sender: str = "sluice",
        attempts: int = ANSWER_ATTEMPTS,
    ) -> None:
        """`producer` builds an unstarted producer, started on the first answer, unless one is `started`
        already (and owned by the caller). `attempts` bounds the tries on the reply topic before the
        answer is dead-lettered."""
        self._redis = redis
        self._names = names
        self._make_producer = producer
        self._producer: AIOKafkaProducer | None = started
        self._owned = started is None
        self._sender = sender
        self._attempts = attempts
        self._lock = asyncio.Lock()

    async def _started(self) -> AIOKafkaProducer:
        async with self._lock:
            if self._producer is None:
                producer = self._make_producer()
                await producer.start()
                self._producer = producer
            return self._producer

    async def deliver(self, topic: str, key: str, answer: BatchAnswer) -> Delivery:
        """Produce `answer` to `topic` unless `key` was answered already; dead-letter it if the topic
        refuses it. Raises BusUnavailable only when neither topic takes it."""
        mark = self._names.answered(key)
        if await self._redis.exists(mark):
            return Delivery.DUPLICATE
        producer = await self._started()
        outcome = Delivery.SENT
        try:
            await with_backoff(
                lambda: producer.send_and_wait(topic, encode(answer), key=key.encode()),
                f"delivering an answer to {topic!r}",
                attempts=self._attempts,
            )
        except BusUnavailable as exc:
            letter = undeliverable(topic, key, answer, str(exc), self._sender)
            try:
                await producer.send_and_wait(self._names.deadletter_topic(), encode(letter))
            except Exception as dead:
                raise BusUnavailable(f"{exc}; the dead-letter topic failed too: {dead}") from dead
            log.warning("answer dead-lettered", topic=topic[:300], request_id=key, reason=letter.reason)
            outcome = Delivery.DEAD_LETTERED
        await self._redis.set(mark, b"1", ex=ANSWERED_TTL_S)
        return outcome

    async def close(self) -> None:
        if self._producer is not None and self._owned:
            await self._producer.stop()
            self._producer = None

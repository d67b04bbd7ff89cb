"""Delivering batch answers to reply topics, once per request.

Whoever ends a batch request (the worker that served it, or the dispatcher that refused or timed it out)
delivers its answer through `AnswerSink`: a request already marked answered is skipped, the answer is
produced with acks=all, then the mark is set. A duplicate can reach the topic only if the deliverer dies
between the produce and the mark; answers carry the request id so readers can drop it (`sluice batch`
does).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import redis.asyncio as aioredis
from aiokafka import AIOKafkaProducer

from queue_schemas.batch import BatchAnswer
from queue_schemas.codec import encode
from queue_schemas.names import Names

ANSWERED_TTL_S = 8 * 24 * 3600  # longer than the longest completion window


class AnswerSink:
    def __init__(
        self,
        redis: aioredis.Redis,
        names: Names,
        producer: Callable[[], AIOKafkaProducer],
        started: AIOKafkaProducer | None = None,
    ) -> None:
        """`producer` builds an unstarted producer, started on the first answer, unless one is `started`
        already (and owned by the caller)."""
        self._redis = redis
        self._names = names
        self._make_producer = producer
        self._producer: AIOKafkaProducer | None = started
        self._owned = started is None
        self._lock = asyncio.Lock()

    async def _started(self) -> AIOKafkaProducer:
        async with self._lock:
            if self._producer is None:
                producer = self._make_producer()
                await producer.start()
                self._producer = producer
            return self._producer

    async def deliver(self, topic: str, key: str, answer: BatchAnswer) -> bool:
        """Produce `answer` to `topic` unless `key` was answered already; True if it was produced."""
        mark = self._names.answered(key)
        if await self._redis.exists(mark):
            return False
        producer = await self._started()
        await producer.send_and_wait(topic, encode(answer), key=key.encode())
        await self._redis.set(mark, b"1", ex=ANSWERED_TTL_S)
        return True

    async def close(self) -> None:
        if self._producer is not None and self._owned:
            await self._producer.stop()
            self._producer = None

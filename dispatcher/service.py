"""The dispatcher loop: receive from Kafka, decide a worker, record and append to its inbox, commit.

An offset is committed only after every record before it in the batch has been placed (or answered,
or dead-lettered), so a dispatcher that dies mid-batch leaves them to be redelivered. Placement is
recorded with SET NX on the request id in the same script as the inbox append, so a redelivered
message is recognised and not placed twice.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import redis.asyncio as aioredis
import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition

from dispatcher.placement import least_loaded
from dispatcher.settings import DispatcherSettings
from dispatcher.view import WorkerView
from queue_schemas.codec import decode, encode
from queue_schemas.errors import ErrorCode, SchemaError
from queue_schemas.messages import DeadLetter, ErrorChunk, InferenceRequest
from queue_schemas.quota import settle

log = structlog.get_logger("sluice.dispatcher")

# KEYS: placement record, worker inbox. ARGV: worker id, record ttl ms, message, inbox max length.
# Returns nil when this call placed the request, else the worker it was already placed on.
PLACE_ONCE = """
local prev = redis.call('GET', KEYS[1])
if prev then return prev end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', 'm', ARGV[3])
return false
"""

DEADLETTER_PAYLOAD_LIMIT = 64 * 1024


class Dispatcher:
    def __init__(self, settings: DispatcherSettings, redis: aioredis.Redis) -> None:
        self.settings = settings
        self.names = settings.names
        self.redis = redis
        self.pool = settings.pool
        self.topic = self.names.requests_topic(settings.pool)
        self.view = WorkerView(redis, self.names, settings.view_refresh_s)
        self.rng = random.Random()
        self._place_once = redis.register_script(PLACE_ONCE)
        self.consumer_id = f"dispatcher-{random.getrandbits(32):08x}"

    async def run(self, consumer: AIOKafkaConsumer, producer: AIOKafkaProducer, stop: asyncio.Event) -> None:
        consumer.subscribe([self.topic])
        log.info("dispatcher consuming", topic=self.topic)
        while not stop.is_set():
            batches: dict[TopicPartition, list[ConsumerRecord[Any, Any]]] = await consumer.getmany(
                timeout_ms=200, max_records=256
            )
            for tp, records in batches.items():
                done = None
                for record in records:
                    if not await self.handle(record, producer, stop):
                        break
                    done = record.offset
                if done is not None:
                    await consumer.commit({tp: done + 1})

    async def handle(
        self, record: ConsumerRecord[Any, Any], producer: AIOKafkaProducer, stop: asyncio.Event
    ) -> bool:
        """Place, answer or dead-letter one record. False means it was left for redelivery (shutdown)."""
        try:
            request = decode(InferenceRequest, record.value or b"")
            if request.pool != self.pool:
                raise SchemaError(
                    f"request for pool {request.pool!r} arrived on the topic of pool {self.pool!r}"
                )
        except SchemaError as exc:
            await self._dead_letter(producer, record, str(exc))
            return True
        structlog.contextvars.bind_contextvars(request_id=request.request_id)
        try:
            return await self._place(request, stop)
        finally:
            structlog.contextvars.unbind_contextvars("request_id")

    async def _place(self, request: InferenceRequest, stop: asyncio.Event) -> bool:
        while not stop.is_set():
            if await self.redis.exists(self.names.cancelled(request.request_id)):
                log.info("dropping cancelled request")
                await settle(self.redis, self.names, request.request_id, 0)
                return True
            if time.time() > request.start_deadline():
                await settle(self.redis, self.names, request.request_id, 0)
                await self._answer_error(
                    request, ErrorCode.TIMEOUT, "no worker could take the request in time"
                )
                return True
            workers = await self.view.snapshot(request.pool)
            worker_id = least_loaded(workers, time.time(), self.rng)
            if worker_id is None:
                await asyncio.sleep(self.settings.hold_poll_s)
                continue
            previous = await self._place_once(
                keys=[self.names.placement(request.request_id), self.names.inbox(worker_id)],
                args=[
                    worker_id,
                    self.settings.placement_ttl_s * 1000,
                    encode(request),
                    self.settings.inbox_max_len,
                ],
            )
            if previous is None:
                self.view.record_placement(worker_id)
                log.debug("placed", worker=worker_id)
            else:
                log.info("already placed; skipping redelivery", worker=previous.decode())
            return True
        return False

    async def _answer_error(self, request: InferenceRequest, code: str, message: str) -> None:
        chunk = ErrorChunk(request_id=request.request_id, seq=0, code=code, message=message)
        await self.redis.publish(self.names.stream_channel(request.request_id), encode(chunk))

    async def _dead_letter(
        self, producer: AIOKafkaProducer, record: ConsumerRecord[Any, Any], reason: str
    ) -> None:
        raw: bytes = record.value or b""
        letter = DeadLetter(
            source=record.topic,
            partition=record.partition,
            offset=record.offset,
            reason=reason,
            payload=raw[:DEADLETTER_PAYLOAD_LIMIT].decode(errors="replace"),
            consumer=self.consumer_id,
            failed_at=time.time(),
        )
        await producer.send_and_wait(self.names.deadletter_topic(), encode(letter))
        log.warning(
            "dead-lettered",
            topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            reason=reason,
        )

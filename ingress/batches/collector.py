"""The batch answers collector: every batch line's answer, from the internal answers topic (one consumer
group across ingresses), into its batch's lines with COLLECT_SCRIPT, which keeps a line's first answer
only. An answer that cannot be used is logged, counted and passed over; an outage reconnects."""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import redis.asyncio as aioredis
import structlog
from aiokafka import AIOKafkaConsumer
from aiokafka.errors import KafkaError
from redis.exceptions import RedisError

from ingress.batches.api import parse_line_request_id, succeeded
from plumbing.health import Liveness, item_failed
from plumbing.protocol.batches import COLLECT_SCRIPT, collect_keys
from queue_schemas.batch import BatchAnswer
from queue_schemas.codec import decode
from queue_schemas.errors import SchemaError
from queue_schemas.names import Names

log = structlog.get_logger("sluice.ingress.batches")

COLLECT_FETCH_WAIT_MS = 500


async def store_line(
    redis: aioredis.Redis, names: Names, team: str, batch_id: str, number: int, line: dict[str, Any]
) -> int:
    """Store a line's answer unless it has one: how many lines have one (-1: no such batch or line, -2:
    the batch is past collecting)."""
    keys = collect_keys(names, team, batch_id)
    ok = "1" if succeeded(line) else "0"
    return int(await redis.eval(COLLECT_SCRIPT, len(keys), *keys, number, json.dumps(line), ok))


class AnswerCollector:
    def __init__(
        self, redis: aioredis.Redis, names: Names, kafka_options: dict[str, Any], interval_s: float,
        liveness: Liveness,
    ) -> None:  # fmt: skip
        self.redis = redis
        self.names = names
        self.interval_s = interval_s
        self.liveness = liveness
        # Answers may wait half a second: a long poll keeps an idle collector cheap for the broker.
        self._kafka_options = {
            **kafka_options,
            "fetch_max_wait_ms": max(int(kafka_options.get("fetch_max_wait_ms", 0)), COLLECT_FETCH_WAIT_MS),
        }

    async def run(self) -> None:
        """Answers of every batch's lines, from the internal answers topic, into their batches."""
        while True:
            consumer = AIOKafkaConsumer(self.names.batch_api_answers_topic(), **self._kafka_options)
            try:
                await consumer.start()
                while True:
                    batches = await consumer.getmany(timeout_ms=500, max_records=500)
                    for records in batches.values():
                        for record in records:
                            await self.collect_alone(record.value or b"")
                    if batches:
                        await consumer.commit()
                    self.liveness.beat("batch-collector")
            except (RedisError, KafkaError, OSError) as exc:
                log.warning("collecting answers failed; reconnecting", error=str(exc))
            finally:
                with contextlib.suppress(KafkaError, OSError):
                    await consumer.stop()
            await asyncio.sleep(self.interval_s)

    async def collect_alone(self, value: bytes) -> None:
        """One answer; one that raises (other than on an outage) is logged, counted and passed over."""
        try:
            await self._collect_one(value)
        except (RedisError, KafkaError, OSError):
            raise
        except Exception as exc:
            item_failed("ingress.batch_collector")
            log.error("an answer could not be collected", error=type(exc).__name__, exc_info=exc)

    async def _collect_one(self, value: bytes) -> None:
        try:
            answer = decode(BatchAnswer, value)
        except SchemaError as exc:
            log.error("an answer on the batch answers topic is not one", error=str(exc))
            return
        where = parse_line_request_id(answer.request_id)
        if where is None:
            log.error("an answer names no line of a batch", request_id=answer.request_id)
            return
        team, batch_id, number = where
        stored = await store_line(self.redis, self.names, team, batch_id, number, answer.output_line())
        if stored == -1:
            log.warning("an answer for no known batch line", batch_id=batch_id, line=number)

"""What the dispatcher writes: a placement (the request's claim, then its inbox entry) and dead letters."""

from __future__ import annotations

import time
from typing import Any

import redis.asyncio as aioredis
import structlog
from aiokafka import AIOKafkaProducer, ConsumerRecord
from aiokafka.errors import KafkaError

from dispatcher import metrics
from dispatcher.hold import Held
from dispatcher.placement import Decision
from dispatcher.settings import DispatcherSettings
from plumbing.clients import BusUnavailable
from plumbing.deadletter import send_dead_letter
from plumbing.protocol.request import PLACE_SCRIPT, Placed, place_keys
from plumbing.replay import LogState, log_ttl_ms
from queue_schemas.codec import encode
from queue_schemas.messages import MoveMark
from queue_schemas.names import INBOX_FIELD

log = structlog.get_logger("sluice.dispatcher")


class Acts:
    def __init__(
        self,
        redis: aioredis.Redis,
        settings: DispatcherSettings,
        producer: AIOKafkaProducer,
        consumer_id: str,
    ) -> None:
        self.settings = settings
        self.names = settings.names
        self.producer = producer
        self.consumer_id = consumer_id
        self._redis = redis
        self._place = redis.register_script(PLACE_SCRIPT)

    async def place(self, held: Held, decision: Decision, log: LogState | None = None) -> str:
        """Claim the request for the decided worker, then append it to that worker's inbox, under the
        writer epoch the claim gives it: 'placed'; or 'redelivered' (claimed earlier, never started:
        appended again to its owner's inbox), 'duplicate', 'cancelled' or 'changed' (a request moved off
        a lost worker, as `log` shows it, whose log changed since)."""
        request = held.request
        names = self.names
        rid = request.request_id
        assert decision.worker_id is not None
        args: list[str | int | bytes] = [
            decision.worker_id,
            self.settings.placement_ttl_s * 1000,
            held.moved_from or "",
        ]
        if held.moved_from is not None:
            assert log is not None, "a move is placed from its log as read"
            point = len(log.events)
            ttl = log_ttl_ms(request.deadline, time.time(), False, request.keep_log_s)
            mark = MoveMark(request_id=rid, epoch=log.epoch + 1, seq=point)
            args += [log.fields, log.epoch, point, ttl, self.settings.stream_publish, encode(mark)]
        reply = await self._place(keys=place_keys(names, rid), args=args)
        outcome, owner, epoch = Placed(_text(reply[0])), _text(reply[1]), int(reply[2])
        if outcome not in (Placed.PLACED, Placed.OWNED):
            return outcome
        if epoch != request.epoch:
            held.request = request = request.model_copy(update={"epoch": epoch})
        await self._redis.xadd(
            names.inbox(owner),
            {INBOX_FIELD: encode(request)},
            maxlen=self.settings.inbox_max_len,
            approximate=True,
        )
        return Placed.PLACED if outcome is Placed.PLACED else "redelivered"

    async def dead_letter(self, record: ConsumerRecord[Any, Any], reason: str) -> None:
        """Send the record to the dead-letter topic; BusUnavailable if the broker does not take it for
        now. A letter the broker refuses for good is logged in its place, so the record's offset can close
        rather than be tried again forever."""
        try:
            await send_dead_letter(
                self.producer, self.names.deadletter_topic(), record, reason, self.consumer_id
            )
        except KafkaError as exc:
            if exc.retriable:
                raise BusUnavailable(f"dead-lettering failed: {exc}") from exc
            metrics.OUTCOMES.labels(self.settings.pool, "dead_letter_refused").inc()
            log.error(
                "the dead-letter topic refused a letter; the record is dropped",
                topic=record.topic, partition=record.partition, offset=record.offset,
                reason=reason[:1024], error=type(exc).__name__,
            )  # fmt: skip
            return
        except Exception as exc:
            raise BusUnavailable(f"dead-lettering failed: {exc}") from exc
        metrics.OUTCOMES.labels(self.settings.pool, "dead_letter").inc()
        log.warning(
            "dead-lettered",
            topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            reason=reason,
        )


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)

"""What the dispatcher writes: a placement (the request's claim, then its inbox entry) and dead letters."""

from __future__ import annotations

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
from queue_schemas.codec import encode
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

    async def place(self, held: Held, decision: Decision, logged: int = 0) -> str:
        """Claim the request for the decided worker, then append it to that worker's inbox: 'placed'; or
        'redelivered' (claimed earlier, never started: appended again to its owner's inbox), 'duplicate',
        'cancelled' or 'changed' (a moved request whose log grew since it held `logged`)."""
        request = held.request
        names = self.names
        rid = request.request_id
        assert decision.worker_id is not None
        reply = await self._place(
            keys=place_keys(names, rid),
            args=[
                decision.worker_id,
                self.settings.placement_ttl_s * 1000,
                held.moved_from or "",
                logged,
            ],
        )
        text, owner = (_text(part) for part in reply)
        outcome = Placed(text)
        if outcome not in (Placed.PLACED, Placed.OWNED):
            return outcome
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

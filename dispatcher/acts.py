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
from queue_schemas.codec import encode
from queue_schemas.names import INBOX_FIELD, Names

log = structlog.get_logger("sluice.dispatcher")

# KEYS: placement record, cancelled mark, replay log, started mark, answered mark (one request's slot).
# ARGV: worker id, record ttl ms, lost worker it moves from ('' if new), and for a move, how many chunks
# the replay log held when the move was decided.
# Claims the request for the worker: 'placed', then the dispatcher appends it to the worker's inbox (the
# worker's slot, so a second step). A move goes ahead only while the lost worker still owns the request
# and its log is as it was read ('changed' otherwise: the log is read again); the new owner fences the
# old one out of the log. A request already claimed by another worker that has neither started it nor
# answered it returns 'owned' and that worker: the claim may have been made by a dispatcher that died
# before the append, so the append is made again (a worker drops a request it already holds).
PLACE_SCRIPT = """
if redis.call('EXISTS', KEYS[2]) == 1 then return {'cancelled', ''} end
local owner = redis.call('GET', KEYS[1])
if owner and (ARGV[3] == '' or owner ~= ARGV[3]) then
  if redis.call('GET', KEYS[4]) == owner or redis.call('EXISTS', KEYS[5]) == 1 then
    return {'duplicate', owner}
  end
  return {'owned', owner}
end
if ARGV[3] ~= '' and redis.call('HLEN', KEYS[3]) ~= tonumber(ARGV[4]) then return {'changed', ''} end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return {'placed', ARGV[1]}
"""


def place_keys(names: Names, request_id: str) -> list[str]:
    """KEYS of PLACE_SCRIPT."""
    return [
        names.placement(request_id),
        names.cancelled(request_id),
        names.replay(request_id),
        names.started(request_id),
        names.answered(request_id),
    ]


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
        outcome, owner = (_text(part) for part in reply)
        if outcome not in ("placed", "owned"):
            return outcome
        await self._redis.xadd(
            names.inbox(owner),
            {INBOX_FIELD: encode(request)},
            maxlen=self.settings.inbox_max_len,
            approximate=True,
        )
        return "placed" if outcome == "placed" else "redelivered"

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

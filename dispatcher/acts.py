"""What the dispatcher writes: a placement (record and inbox entry in one script) and dead letters."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
import structlog
from aiokafka import AIOKafkaProducer, ConsumerRecord

from dispatcher import metrics
from dispatcher.hold import Held
from dispatcher.placement import Decision
from dispatcher.settings import DispatcherSettings
from queue_schemas.clients import BusUnavailable
from queue_schemas.codec import encode
from queue_schemas.deadletter import send_dead_letter

log = structlog.get_logger("sluice.dispatcher")

# KEYS: placement record, cancelled mark, worker inbox, replay log.
# ARGV: worker id, record ttl ms, message, inbox max length, lost worker it moves from ('' if new),
# and for a move, how many chunks the replay log held when the move was decided.
# A move goes ahead only while the lost worker still owns the request and its log is as it was read
# ('changed' otherwise: the log is read again); the new owner fences the old one out of the log.
PLACE_SCRIPT = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 'cancelled' end
local owner = redis.call('GET', KEYS[1])
if ARGV[5] == '' then
  if owner then return 'duplicate' end
else
  if owner and owner ~= ARGV[5] then return 'duplicate' end
  if redis.call('HLEN', KEYS[4]) ~= tonumber(ARGV[6]) then return 'changed' end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[4], '*', 'm', ARGV[3])
return 'placed'
"""


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
        self._place = redis.register_script(PLACE_SCRIPT)

    async def place(self, held: Held, decision: Decision, logged: int = 0) -> str:
        """Record the placement and append the request to the worker's inbox, atomically: 'placed', or
        'duplicate', 'cancelled' or 'changed' (a moved request whose log grew since it held `logged`)."""
        request = held.request
        names = self.names
        rid = request.request_id
        assert decision.worker_id is not None
        outcome = await self._place(
            keys=[
                names.placement(rid),
                names.cancelled(rid),
                names.inbox(decision.worker_id),
                names.replay(rid),
            ],
            args=[
                decision.worker_id,
                self.settings.placement_ttl_s * 1000,
                encode(request),
                self.settings.inbox_max_len,
                held.moved_from or "",
                logged,
            ],
        )
        return outcome.decode() if isinstance(outcome, bytes) else str(outcome)

    async def dead_letter(self, record: ConsumerRecord[Any, Any], reason: str) -> None:
        """Send the record to the dead-letter topic; BusUnavailable if the broker does not take it."""
        try:
            await send_dead_letter(
                self.producer, self.names.deadletter_topic(), record, reason, self.consumer_id
            )
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

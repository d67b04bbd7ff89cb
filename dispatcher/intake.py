"""Receiving and acknowledging: records from the leased partitions into the hold (batch records admitted
in the background, malformed ones dead-lettered), offsets committed up to the oldest request still
held, partitions paused while a class's hold is full."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import structlog
from aiokafka import ConsumerRecord, TopicPartition
from redis.exceptions import RedisError

from dispatcher import metrics, tracing
from dispatcher.batch_desk import Refusal
from dispatcher.hold import Held
from dispatcher.state import DispatcherState
from plumbing.clients import BusUnavailable
from queue_schemas.codec import decode
from queue_schemas.errors import SchemaError
from queue_schemas.messages import (
    InferenceRequest,
    Priority,
)

log = structlog.get_logger("sluice.dispatcher")


def as_received(request: InferenceRequest) -> InferenceRequest:
    """A request as read from its topic, with what only a dispatcher sets taken off: its handoff, its
    placement note and its writer epoch (set by the dispatcher that places it), and a resume record (a
    request moves only from a lost worker's inbox, never from a topic; a record claiming one would have
    its prompt charged as if already paid for). Pure."""
    if (
        request.handoff is None
        and request.placement is None
        and request.epoch == 0
        and request.resume is None
    ):
        return request
    return request.model_copy(update={"handoff": None, "placement": None, "epoch": 0, "resume": None})


class Intake(DispatcherState):
    async def _follow_leases(self) -> None:
        """Consume exactly the leased partitions. One given up first commits what is finished and
        forgets what is held from it (the next holder reads those records again)."""
        dropped = self.partitions.to_drop()
        if dropped:
            with contextlib.suppress(Exception):
                await self._acknowledge()
            self.revoked(dropped)
        self.partitions.follow(dropped, self._paused)
        metrics.CONSUMING.labels(self.pool).set(len(self.partitions.owned()))

    async def _receive(self) -> None:
        if self._unadmitted:  # batch records whose admission met a Redis failure: theirs is the next try
            retry, self._unadmitted = self._unadmitted, []
            for record in retry:
                self.in_flight.start(self._admit_batch(record), "admit")
        wait_ms = int(self.settings.hold_poll_s * 1000) if len(self.hold) else 200
        batches: dict[TopicPartition, list[ConsumerRecord[Any, Any]]] = await self.consumer.getmany(
            timeout_ms=wait_ms, max_records=self.settings.fetch_max_records
        )
        self.fetch_pacer.observe(sum(len(records) for records in batches.values()), time.monotonic())
        batch_records = []
        for tp, records in batches.items():
            kind = "batch" if tp.topic == self.batch_topic else "requests"
            metrics.RECEIVED.labels(self.pool, kind).inc(len(records))
            for record in records:
                self.offsets.opened((tp.topic, tp.partition), record.offset)
                if tp.topic == self.batch_topic:
                    batch_records.append(record)
                else:
                    await self._admit(record)
        # Interactive records first; batch ones are admitted in the background (their signatures, schema
        # checks and tokenizing), so neither a large fetch of them nor a slow one holds up placement.
        for record in batch_records:
            self.in_flight.start(self._admit_batch(record), "admit")

    async def _admit_batch(self, record: ConsumerRecord[Any, Any]) -> None:
        source = (record.topic, record.partition)
        try:
            request = await self.batch.admit(record)
        except (RedisError, BusUnavailable) as exc:
            log.warning("batch record not admitted yet; bus unavailable", error=str(exc))
            self._unadmitted.append(record)  # its offset stays open: it is neither lost nor committed
            return
        except Exception as exc:  # a fault of this record's alone: dead-lettered, never the loop's end
            log.error("batch record failed admission", error=type(exc).__name__, exc_info=True)
            with contextlib.suppress(BusUnavailable):
                await self.acts.dead_letter(record, f"admission failed: {type(exc).__name__}")
            self.offsets.closed(source, record.offset)
            return
        if isinstance(request, Refusal):
            self.in_flight.deliver(
                request.send,
                done=lambda: self.offsets.closed(source, record.offset),
                retry=lambda: self._unadmitted.append(record),
            )
        elif request is None:
            self.offsets.closed(source, record.offset)
        else:
            self._hold_batch(request, record)

    def _hold_batch(self, request: InferenceRequest, record: ConsumerRecord[Any, Any]) -> None:
        source = (record.topic, record.partition)
        request, produced = tracing.received(request, record.headers, record.timestamp, time.time())
        held = Held(request, source, record.offset, time.monotonic(), produced_at=produced)
        if not self.hold.add(held) and not self.hold.holds_record(request.request_id, source, record.offset):
            self.offsets.closed(source, record.offset)  # another record of a request already held

    async def _admit(self, record: ConsumerRecord[Any, Any]) -> None:
        try:
            request = decode(InferenceRequest, record.value or b"")
            if request.pool != self.pool:
                raise SchemaError(
                    f"request for pool {request.pool!r} arrived on the topic of pool {self.pool!r}"
                )
        except SchemaError as exc:
            with contextlib.suppress(BusUnavailable):  # logged by the dead-letter path
                await self.acts.dead_letter(record, str(exc))
            self.offsets.closed((record.topic, record.partition), record.offset)
            return
        request = as_received(request)
        source = (record.topic, record.partition)
        request, produced = tracing.received(request, record.headers, record.timestamp, time.time())
        held = Held(request, source, record.offset, time.monotonic(), produced_at=produced)
        if not self.hold.add(held):
            metrics.OUTCOMES.labels(self.pool, "duplicate").inc()
            # The same record read again keeps its offset open for the held copy; another record of the
            # request is done with.
            if not self.hold.holds_record(request.request_id, source, record.offset):
                self.offsets.closed(source, record.offset)

    async def _acknowledge(self) -> None:
        offsets = self.offsets.to_commit()
        assigned = {(tp.topic, tp.partition) for tp in self.consumer.assignment()}
        offsets = {p: o for p, o in offsets.items() if p in assigned}
        if offsets:
            await self.consumer.commit({TopicPartition(*p): o for p, o in offsets.items()})
            self.offsets.committed(offsets)
        metrics.COMMIT_ROUNDS.labels(self.pool).inc()

    def _flow_control(self) -> None:
        """Each class has its own bound in the hold, so a batch flood never pauses interactive partitions."""
        bounds = (
            (self.topic, Priority.INTERACTIVE, self.settings.hold_capacity),
            (self.batch_topic, Priority.BATCH, self.settings.batch_hold_capacity),
        )
        for topic, priority, capacity in bounds:
            assigned = [tp for tp in self.consumer.assignment() if tp.topic == topic]
            # Admissions and answers under way hold their records' offsets too: they count against the bound.
            size = self.hold.size(priority) + (len(self.in_flight) if priority is Priority.BATCH else 0)
            if topic not in self._paused and size >= capacity:
                self.consumer.pause(*assigned)
                self._paused.add(topic)
                log.warning("hold full; pausing partitions", topic=topic, held=size)
            elif topic in self._paused and size <= capacity * 3 // 4:
                self.consumer.resume(*assigned)
                self._paused.discard(topic)
                log.info("resuming partitions", topic=topic, held=size)
        metrics.PAUSED.labels(self.pool).set(1 if self.topic in self._paused else 0)

    def revoked(self, partitions: set[tuple[str, int]]) -> None:
        """Partitions moved to another member: forget what was held from them; it is redelivered there."""
        for held in self.hold.from_partitions(partitions):
            self.hold.remove(held.request.request_id)
        self.offsets.forget(partitions)

"""Moves usage events from the teams' outbox streams in Redis to the `<prefix>.usage` topic.

The settle script writes each request's event to its team's outbox once (plumbing.quota). Every
ingress runs a relay; they share each outbox through one consumer group, so an entry goes to one relay,
and an entry a dead relay had taken is claimed by another after `claim_idle_s`. An entry is
acknowledged and deleted only after the broker has the record. A relay that dies between the two
produces that entry again: the record is the same (same key, same content), and readers count a
request id once (docs/usage.md).

An entry that cannot become a record (not a usage event, not encodable, refused by the broker as a
record) is dropped alone, logged and counted in `sluice_items_failed_total{loop="ingress.usage_relay"}`;
an outbox Redis refuses to read is passed over; the relay goes on with the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Iterable
from typing import Any

import redis.asyncio as aioredis
import structlog
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError, MessageSizeTooLargeError, RecordTooLargeError
from redis.exceptions import RedisError, ResponseError

from plumbing.health import Liveness, item_failed
from plumbing.tasks import stop_task
from queue_schemas.names import Names
from queue_schemas.usage import UsageEvent

log = structlog.get_logger("sluice.ingress.usage")

RELAY_GROUP = "relay"
CLAIM_IDLE_S = 30.0
DISCOVER_EVERY_S = 5.0  # a team's first events wait at most this long
READ_COUNT = 500
RELAY_LOOP = "usage-relay"  # its name in /healthz
RELAY_ITEMS = "ingress.usage_relay"  # the `loop` label of entries it dropped
RELAY_STALE_S = 120.0  # /healthz: a relay with no round for this long is stuck
# What the broker answers about one record that it will never take, however often it is sent.
REFUSED_RECORD = (MessageSizeTooLargeError, RecordTooLargeError)

Entry = tuple[bytes, dict[bytes, bytes]]


def relayed_event(fields: dict[bytes, bytes]) -> UsageEvent:
    """The record of an outbox entry: the event with what the settle script found was charged."""
    event = UsageEvent.model_validate_json(fields[b"e"])
    return event.model_copy(update={"charged_tokens": int(float(fields[b"charged"]))})


def outbox_record(fields: dict[bytes, bytes]) -> tuple[bytes, bytes]:
    """(value, key) of an outbox entry's record; raises on an entry that cannot be one."""
    event = relayed_event(fields)
    return event.model_dump_json().encode(), event.request_id.encode()


def team_names(members: Iterable[bytes | str]) -> set[str]:
    """The teams registered in the outbox set; a member that is not UTF-8 names no team's outbox."""
    names: set[str] = set()
    for member in members:
        with contextlib.suppress(UnicodeDecodeError):
            names.add(member.decode() if isinstance(member, bytes) else member)
    return names


def entry_settled(delivery: object) -> bool:
    """Whether an entry is done with once its send ended this way: sent, or refused for good. Any other
    failure leaves it pending, for this relay or another to send again."""
    return not isinstance(delivery, BaseException) or isinstance(delivery, REFUSED_RECORD)


class UsageRelay:
    def __init__(
        self,
        names: Names,
        redis: aioredis.Redis,
        producer: AIOKafkaProducer,
        interval_s: float,
        claim_idle_s: float = CLAIM_IDLE_S,
        liveness: Liveness | None = None,
    ) -> None:
        self.names = names
        self.liveness = liveness or Liveness()
        self.claim_idle_ms = int(claim_idle_s * 1000)
        self.redis = redis
        self.producer = producer
        self.interval_s = interval_s
        self.consumer = "relay-" + secrets.token_hex(6)
        self._streams: set[str] = set()
        self._discovered_at = 0.0
        self._claimed_at = 0.0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=RELAY_LOOP)
        self.liveness.watch(RELAY_LOOP, self._task, stale_after_s=RELAY_STALE_S)

    async def close(self) -> None:
        if self._task is not None:
            self.liveness.forget(RELAY_LOOP)
            await stop_task(self._task)

    async def _run(self) -> None:
        while True:
            self.liveness.beat(RELAY_LOOP)
            try:
                moved = await self.relay_once()
            except (RedisError, KafkaError, OSError) as exc:
                log.warning("relaying usage failed; retrying", error=str(exc))
                moved = 0
            except Exception as exc:  # a fault outside any one entry: the next round tries again
                log.error("relaying usage failed", error=type(exc).__name__, exc_info=True)
                moved = 0
            if not moved:
                await asyncio.sleep(self.interval_s)

    async def relay_once(self) -> int:
        """One pass over every outbox: returns how many entries went to the topic."""
        now = time.monotonic()
        if now - self._discovered_at > DISCOVER_EVERY_S:
            await self._discover()
        claim = now - self._claimed_at > self.claim_idle_ms / 2000
        if claim:
            self._claimed_at = now
        moved = 0
        for stream in sorted(self._streams):
            try:
                moved += await self._relay_stream(stream, claim)
            except ResponseError as exc:  # Redis refuses this outbox (not a stream): the others go on
                self._pass_over(stream, exc)
        return moved

    async def _discover(self) -> None:
        """The outboxes of the teams registered in the set (plumbing.quota.register_outbox)."""
        teams = await self.redis.smembers(self.names.usage_teams())
        found = {self.names.usage_outbox(t) for t in team_names(teams)}
        for stream in found - self._streams:
            try:
                await self.redis.xgroup_create(stream, RELAY_GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    self._pass_over(stream, exc)
                    found.discard(stream)
        self._streams = found
        self._discovered_at = time.monotonic()

    def _pass_over(self, stream: str, exc: ResponseError) -> None:
        item_failed(RELAY_ITEMS)
        log.error("an outbox cannot be read; passed over", stream=stream, error=str(exc))

    async def _relay_stream(self, stream: str, claim: bool) -> int:
        """Send an outbox's new (and, with `claim`, abandoned) entries; acknowledge and delete those the
        broker took or refused for good, and those dropped here. Returns how many entries were read."""
        entries = await self._read(stream, claim)
        if not entries:
            return 0
        done: list[bytes] = []
        sending: list[tuple[bytes, asyncio.Future[Any]]] = []
        for entry_id, fields in entries:
            delivery = await self._send(stream, entry_id, fields)
            if delivery is None:
                done.append(entry_id)
            else:
                sending.append((entry_id, delivery))
        results = await asyncio.gather(*(delivery for _, delivery in sending), return_exceptions=True)
        for (entry_id, _), result in zip(sending, results, strict=True):
            if isinstance(result, BaseException):
                self._report_failed_send(stream, entry_id, result)
            if entry_settled(result):
                done.append(entry_id)
        if done:
            await self.redis.xack(stream, RELAY_GROUP, *done)
            await self.redis.xdel(stream, *done)
        return len(entries)

    async def _read(self, stream: str, claim: bool) -> list[Entry]:
        entries: list[Entry] = []
        if claim:  # entries another relay took and never acknowledged
            claimed = await self.redis.xautoclaim(
                stream, RELAY_GROUP, self.consumer, self.claim_idle_ms, start_id="0-0", count=READ_COUNT
            )
            entries += claimed[1]
        reply: Any = await self.redis.xreadgroup(RELAY_GROUP, self.consumer, {stream: ">"}, count=READ_COUNT)
        for _, items in reply or []:
            entries += items
        return entries

    async def _send(
        self, stream: str, entry_id: bytes, fields: dict[bytes, bytes]
    ) -> asyncio.Future[Any] | None:
        """Hand one entry's record to the producer: its delivery, or None for an entry ended here (deleted
        after it was read, or one that cannot become a record: dropped). A producer failure that is not
        about this record (the broker unreachable) is raised: the round stops, the entries stay pending."""
        if not fields:
            return None
        try:
            value, key = outbox_record(fields)
            delivery: asyncio.Future[Any] = await self.producer.send(self.names.usage_topic(), value, key=key)
            return delivery
        except KafkaError as exc:
            if not isinstance(exc, REFUSED_RECORD):
                raise
            self._drop(stream, entry_id, exc)
        except Exception as exc:
            self._drop(stream, entry_id, exc)
        return None

    def _report_failed_send(self, stream: str, entry_id: bytes, exc: BaseException) -> None:
        if isinstance(exc, REFUSED_RECORD):
            self._drop(stream, entry_id, exc)
        else:
            log.warning("usage record not sent; it stays pending", stream=stream, error=repr(exc))

    def _drop(self, stream: str, entry_id: bytes, exc: BaseException) -> None:
        item_failed(RELAY_ITEMS)
        log.error(
            "an outbox entry cannot be relayed; dropped",
            stream=stream, entry=entry_id.decode(errors="replace"), error=type(exc).__name__, reason=str(exc),
        )  # fmt: skip

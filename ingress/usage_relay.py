"""Moves usage events from the teams' outbox streams in Redis to the `<prefix>.usage` topic.

The settle script writes each request's event to its team's outbox once (queue_schemas.quota). Every
ingress runs a relay; they share each outbox through one consumer group, so an entry goes to one relay,
and an entry a dead relay had taken is claimed by another after `claim_idle_s`. An entry is
acknowledged and deleted only after the broker has the record. A relay that dies between the two
produces that entry again: the record is the same (same key, same content), and readers count a
request id once (docs/usage.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from typing import Any

import redis.asyncio as aioredis
import structlog
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from redis.exceptions import RedisError, ResponseError

from queue_schemas.names import Names
from queue_schemas.usage import UsageEvent

log = structlog.get_logger("sluice.ingress.usage")

RELAY_GROUP = "relay"
CLAIM_IDLE_S = 30.0
DISCOVER_EVERY_S = 5.0  # a team's first events wait at most this long
READ_COUNT = 500


def relayed_event(fields: dict[bytes, bytes]) -> UsageEvent:
    """The record of an outbox entry: the event with what the settle script found was charged."""
    event = UsageEvent.model_validate_json(fields[b"e"])
    return event.model_copy(update={"charged_tokens": int(float(fields[b"charged"]))})


class UsageRelay:
    def __init__(
        self,
        names: Names,
        redis: aioredis.Redis,
        producer: AIOKafkaProducer,
        interval_s: float,
        claim_idle_s: float = CLAIM_IDLE_S,
    ) -> None:
        self.names = names
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
        self._task = asyncio.create_task(self._run(), name="usage-relay")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            try:
                moved = await self.relay_once()
            except (RedisError, KafkaError, OSError) as exc:
                log.warning("relaying usage failed; retrying", error=str(exc))
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
            moved += await self._relay_stream(stream, claim)
        return moved

    async def _discover(self) -> None:
        """The outboxes of the teams registered in the set (queue_schemas.quota.register_outbox)."""
        teams = await self.redis.smembers(self.names.usage_teams())
        found = {self.names.usage_outbox(t.decode() if isinstance(t, bytes) else t) for t in teams}
        for stream in found - self._streams:
            try:
                await self.redis.xgroup_create(stream, RELAY_GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        self._streams = found
        self._discovered_at = time.monotonic()

    async def _relay_stream(self, stream: str, claim: bool) -> int:
        entries: list[tuple[bytes, dict[bytes, bytes]]] = []
        if claim:  # entries another relay took and never acknowledged
            claimed = await self.redis.xautoclaim(
                stream, RELAY_GROUP, self.consumer, self.claim_idle_ms, start_id="0-0", count=READ_COUNT
            )
            entries += claimed[1]
        reply: Any = await self.redis.xreadgroup(RELAY_GROUP, self.consumer, {stream: ">"}, count=READ_COUNT)
        for _, items in reply or []:
            entries += items
        if not entries:
            return 0
        sends = []
        for _, fields in entries:
            if not fields:  # deleted after it was read: nothing to send
                continue
            try:
                event = relayed_event(fields)
            except (ValueError, KeyError) as exc:
                log.error("an outbox entry is not a usage event; dropped", stream=stream, error=str(exc))
                continue
            value = event.model_dump_json().encode()
            sends.append(
                await self.producer.send(self.names.usage_topic(), value, key=event.request_id.encode())
            )
        await asyncio.gather(*sends)
        ids = [entry_id for entry_id, _ in entries]
        await self.redis.xack(stream, RELAY_GROUP, *ids)
        await self.redis.xdel(stream, *ids)
        return len(entries)

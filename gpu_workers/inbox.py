"""A worker's inbox: the Redis Stream the dispatcher appends to, read through a consumer group."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError, ResponseError

from queue_schemas.names import INBOX_FIELD, WORKER_INBOX_GROUP, Names

log = structlog.get_logger("sluice.worker.inbox")

Entry = tuple[bytes, dict[bytes, bytes]]
LEFT_BY_TTL_MS = 24 * 3600 * 1000


def inbox_entries(reply: Any) -> list[Entry]:
    """Entries of the one stream read by XREADGROUP, whether the reply came as RESP2 lists or a RESP3 map."""
    if not reply:
        return []
    streams = list(reply.values()) if isinstance(reply, dict) else [item[1] for item in reply]
    entries: list[Entry] = []
    for stream in streams:
        entries.extend((entry_id, fields or {}) for entry_id, fields in stream)
    return entries


class Inbox:
    def __init__(self, redis: aioredis.Redis, names: Names, worker_id: str) -> None:
        self._redis = redis
        self._names = names
        self.key = names.inbox(worker_id)
        self._worker_id = worker_id
        # Entries this worker id read before a restart but never acknowledged come first ("0").
        self._cursor = "0"

    async def ensure(self) -> None:
        try:
            await self._redis.xgroup_create(self.key, WORKER_INBOX_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def hand_over(self, pool: str) -> int:
        """Give what an earlier process under this worker id left in the inbox to the dispatchers, as a
        lost worker's: the entries are copied to the inbox of a fresh id that is a pool member without a
        heartbeat, `left_by` names the id its requests were placed on, and this inbox is emptied. A
        dispatcher takes it over at once and moves each request on from what its stream delivered, while
        this process is still starting (loading a model can take minutes). The two inboxes hash to
        different slots on a Redis Cluster, so this is steps, not one transaction: a process that dies
        half-way hands the same entries over again when it restarts, and a request moved twice is
        refused by its placement record the second time. Returns how many entries were handed over."""
        entries = await self._redis.xrange(self.key, "-", "+") or []
        if not entries:
            return 0
        orphan = f"{self._worker_id[:40]}-left-{time.time_ns() % 10**12}"
        async with self._redis.pipeline(transaction=False) as pipe:
            for _entry_id, fields in entries:
                pipe.xadd(self._names.inbox(orphan), {INBOX_FIELD: (fields or {}).get(INBOX_FIELD, b"")})
            pipe.set(self._names.left_by(orphan), self._worker_id, px=LEFT_BY_TTL_MS)
            await pipe.execute()
        await self._redis.sadd(self._names.workers(pool), orphan)
        await self._redis.delete(self.key)
        log.warning("handed an earlier process's unfinished entries to the dispatchers", entries=len(entries))
        return len(entries)

    async def read(self, count: int, block_ms: int | None) -> list[Entry]:
        """Up to `count` entries: first our own unacknowledged history, then new ones; `block_ms` None
        returns at once."""
        try:
            reply = await self._redis.xreadgroup(
                WORKER_INBOX_GROUP, self._worker_id, {self.key: self._cursor}, count=count, block=block_ms
            )
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            # The inbox was taken over while this worker was presumed lost: start a fresh one.
            log.warning("inbox was reset; recreating it")
            await self.ensure()
            return []
        entries = inbox_entries(reply)
        if self._cursor != ">":
            self._cursor = entries[-1][0].decode() if entries else ">"
        return entries

    async def done(self, entry_id: bytes) -> None:
        """Acknowledge and delete an entry, so what stays in an inbox is unfinished work."""
        with contextlib.suppress(RedisError):
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.xack(self.key, WORKER_INBOX_GROUP, entry_id)
                pipe.xdel(self.key, entry_id)
                await pipe.execute()

    async def undelivered(self) -> int:
        try:
            groups = await self._redis.xinfo_groups(self.key)
        except ResponseError:
            return 0
        for group in groups:
            if group.get("name") in (WORKER_INBOX_GROUP, WORKER_INBOX_GROUP.encode()):
                return int(group.get("lag") or 0)
        return 0

    async def length(self) -> int:
        return int(await self._redis.xlen(self.key))

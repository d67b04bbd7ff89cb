"""The dispatcher's live view of a pool's workers, read from their heartbeat keys in Redis."""

from __future__ import annotations

import time
from collections import defaultdict

import redis.asyncio as aioredis
import structlog

from dispatcher.placement import WorkerSnapshot
from queue_schemas.codec import decode
from queue_schemas.errors import SchemaError
from queue_schemas.messages import Heartbeat
from queue_schemas.names import Names

log = structlog.get_logger("sluice.dispatcher.view")


class WorkerView:
    """Heartbeats are re-read at most every `refresh_s`; placements since a heartbeat count as in flight."""

    def __init__(self, redis: aioredis.Redis, names: Names, refresh_s: float) -> None:
        self._redis = redis
        self._names = names
        self._refresh_s = refresh_s
        self._heartbeats: dict[str, list[Heartbeat]] = {}
        self._read_at: dict[str, float] = {}
        self._placed: dict[str, list[float]] = defaultdict(list)

    async def snapshot(self, pool: str) -> list[WorkerSnapshot]:
        now = time.monotonic()
        if now - self._read_at.get(pool, float("-inf")) >= self._refresh_s:
            self._heartbeats[pool] = await self._read(pool)
            self._read_at[pool] = now
        out = []
        for hb in self._heartbeats.get(pool, []):
            placed = self._placed[hb.worker_id]
            placed[:] = [t for t in placed if t > hb.sent_at]
            out.append(WorkerSnapshot(hb, in_flight=len(placed)))
        return out

    def record_placement(self, worker_id: str) -> None:
        self._placed[worker_id].append(time.time())

    async def _read(self, pool: str) -> list[Heartbeat]:
        members = await self._redis.smembers(self._names.workers(pool))
        ids = sorted(m.decode() if isinstance(m, bytes) else m for m in members)
        if not ids:
            return []
        raws = await self._redis.mget([self._names.heartbeat(pool, w) for w in ids])
        beats = []
        gone = []
        for worker_id, raw in zip(ids, raws, strict=True):
            if raw is None:
                gone.append(worker_id)
                continue
            try:
                beats.append(decode(Heartbeat, raw))
            except SchemaError as exc:
                log.warning("ignoring bad heartbeat", worker=worker_id, reason=str(exc))
        if gone:
            # An expired heartbeat means the worker is gone; forget it so the set does not grow forever.
            await self._redis.srem(self._names.workers(pool), *gone)
        return beats

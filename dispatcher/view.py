"""The dispatcher's live view of a pool's workers, read from their heartbeat keys in Redis."""

from __future__ import annotations

import time
from collections import defaultdict

import redis.asyncio as aioredis

from dispatcher.placement import WorkerSnapshot
from queue_schemas.messages import Heartbeat
from queue_schemas.names import Names
from queue_schemas.state import read_heartbeats


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
            self._heartbeats[pool] = await read_heartbeats(self._redis, self._names, pool)
            self._read_at[pool] = now
        out = []
        for hb in self._heartbeats.get(pool, []):
            placed = self._placed[hb.worker_id]
            placed[:] = [t for t in placed if t > hb.sent_at]
            out.append(WorkerSnapshot(hb, in_flight=len(placed)))
        return out

    def record_placement(self, worker_id: str) -> None:
        self._placed[worker_id].append(time.time())

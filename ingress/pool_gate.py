"""Pool admission: refuse quickly when a pool has no worker or its backlog is at its bound.

The scaler observes each pool and writes a PoolState; ingress reads it (cached briefly). If the state is
missing or stale the gate stays open: the scaler is an observer, not a dependency of serving.
"""

from __future__ import annotations

import time

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from openai_api.errors import ApiError, ServiceUnavailable
from queue_schemas.codec import decode
from queue_schemas.config import PoolConfig
from queue_schemas.errors import SchemaError
from queue_schemas.messages import POOL_STATE_STALE_S, PoolState
from queue_schemas.names import Names

CACHE_S = 0.5
OVERLOADED_RETRY_S = 2
NO_WORKERS_RETRY_S = 10


def pool_refusal(pool: PoolConfig, state: PoolState | None, now: float) -> ApiError | None:
    """Why the pool cannot take a request now, or None when it can (or when nothing is known).

    A pool with no replica up still admits requests when the scaler can start one for them (its
    minimum is above zero, or it scales from zero on demand); they wait up to the queue timeout.
    """
    if state is None or now - state.updated_at > POOL_STATE_STALE_S:
        return None
    if state.ready + state.starting == 0 and not pool.scaling.can_activate:
        return ServiceUnavailable(
            f"No worker is serving the model '{pool.model}' right now; retry later.",
            code="no_workers",
            headers={"retry-after": str(NO_WORKERS_RETRY_S)},
        )
    if state.backlog >= pool.max_queued:
        return ServiceUnavailable(
            f"The model '{pool.model}' is overloaded ({state.backlog} requests queued); retry shortly.",
            code="server_overloaded",
            headers={"retry-after": str(OVERLOADED_RETRY_S)},
        )
    return None


class PoolGate:
    def __init__(self, redis: aioredis.Redis, names: Names) -> None:
        self._redis = redis
        self._names = names
        self._cache: dict[str, tuple[float, PoolState | None]] = {}

    async def check(self, pool: PoolConfig) -> None:
        refusal = pool_refusal(pool, await self._state(pool.name), time.time())
        if refusal is not None:
            raise refusal

    async def _state(self, pool: str) -> PoolState | None:
        now = time.monotonic()
        cached = self._cache.get(pool)
        if cached is not None and now - cached[0] < CACHE_S:
            return cached[1]
        try:
            raw = await self._redis.get(self._names.pool_state(pool))
        except RedisError:
            return cached[1] if cached else None
        state = None
        if raw is not None:
            try:
                state = decode(PoolState, raw)
            except SchemaError:
                state = None
        self._cache[pool] = (now, state)
        return state

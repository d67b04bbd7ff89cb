"""Reading the workers' live state from Redis, the same way in every service that needs it."""

from __future__ import annotations

import redis.asyncio as aioredis
import structlog

from queue_schemas.codec import decode
from queue_schemas.errors import SchemaError
from queue_schemas.messages import Heartbeat
from queue_schemas.names import Names

log = structlog.get_logger("sluice.state")


async def read_heartbeats(
    redis: aioredis.Redis, names: Names, pool: str
) -> tuple[list[Heartbeat], list[str]]:
    """The live heartbeats of a pool's workers, and the members whose heartbeat expired (gone).

    Gone workers stay in the set: the dispatcher that recovers their inbox removes them.
    """
    members = await redis.smembers(names.workers(pool))
    ids = sorted(m.decode() if isinstance(m, bytes) else m for m in members)
    if not ids:
        return [], []
    raws = await redis.mget([names.heartbeat(pool, w) for w in ids])
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
    return beats, gone

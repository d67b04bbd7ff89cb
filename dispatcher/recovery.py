"""Taking over the inbox of a worker whose heartbeat expired.

One dispatcher wins a short lock per lost worker, reads every entry left in its inbox (entries are
deleted when a worker finishes them, so what remains never finished) and clears the worker's keys. The
returned requests go back into the hold, placed whole or as the continuation of what their replay log
shows was delivered (dispatcher.migration); the placement script checks, atomically, that the log has
not grown since it was read (plumbing.protocol.request.PLACE_SCRIPT).
"""

from __future__ import annotations

import redis.asyncio as aioredis
import structlog

from queue_schemas.codec import decode
from queue_schemas.errors import SchemaError
from queue_schemas.messages import InferenceRequest
from queue_schemas.names import INBOX_FIELD, Names

log = structlog.get_logger("sluice.dispatcher.recovery")

LOCK_TTL_MS = 60_000


async def take_over(
    redis: aioredis.Redis, names: Names, pool: str, worker_id: str
) -> list[InferenceRequest] | None:
    """The unfinished requests of a lost worker, or None if another dispatcher is recovering it."""
    if not await redis.set(names.recovery_lock(worker_id), "1", nx=True, px=LOCK_TTL_MS):
        return None
    entries = await redis.xrange(names.inbox(worker_id), "-", "+") or []
    requests = []
    for entry_id, fields in entries:
        try:
            requests.append(decode(InferenceRequest, (fields or {}).get(INBOX_FIELD, b"")))
        except SchemaError as exc:
            log.error(
                "dropping unreadable inbox entry", worker=worker_id, entry=str(entry_id), reason=str(exc)
            )
    async with redis.pipeline(transaction=False) as pipe:
        pipe.delete(names.inbox(worker_id), names.kv_index(worker_id), names.kv_snapshot(worker_id))
        pipe.srem(names.workers(pool), worker_id)
        await pipe.execute()
    log.warning("took over a lost worker's inbox", worker=worker_id, requests=len(requests))
    return requests

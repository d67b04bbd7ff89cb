"""Stored responses (/v1/responses) in Redis: a record per response beside its request's replay log.

The record (`resp:{<request id>}`, in the request's slot) holds what the response object echoes and
who owns it; the response's output is its request's replay log, read again whenever the response is
retrieved or its stream resumed (ingress.responses.events). Record and log expire at the same
moment: `responses_retain_s` past the request's deadline.

A cancel is one script on the request's keys: it marks the request cancelled (a worker that has not
started it never will), notes the time in the record, and, for a request no worker has started, ends
its stream at once with a `cancelled` error chunk (nothing else would: its dispatcher drops it
silently). A started request's worker stops at the cancel notice and logs the error chunk itself,
after charging the team what was generated.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
import redis.asyncio as aioredis

from ingress.responses.events import ResponseRecord
from plumbing.protocol.request import CANCEL_MARK_TTL_MS, CANCEL_SCRIPT, ResponseCancel, cancel_keys
from queue_schemas.codec import encode
from queue_schemas.errors import ErrorCode
from queue_schemas.messages import ErrorChunk
from queue_schemas.names import Names

RECORD = "record"
CANCELLED = "cancelled"
INPUT = "input"  # the conversation's input items (this turn's and every earlier turn's), JSON


class ResponseStore:
    def __init__(self, redis: aioredis.Redis, names: Names, publish_command: str, keep_s: int) -> None:
        self._redis = redis
        self._names = names
        self._publish = publish_command
        self.keep_s = keep_s
        self._cancel = redis.register_script(CANCEL_SCRIPT)

    def _ttl_ms(self, record: ResponseRecord) -> int:
        """Until `keep_s` past the deadline: when its request's replay log expires too."""
        return max(1000, int((record.deadline - time.time() + self.keep_s) * 1000))

    async def save(self, record: ResponseRecord, items: list[dict[str, Any]]) -> None:
        key = self._names.response(record.request_id)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hset(key, mapping={RECORD: record.model_dump_json(), INPUT: orjson.dumps(items)})
            pipe.pexpire(key, self._ttl_ms(record))
            await pipe.execute()

    async def input_items(self, request_id: str) -> list[dict[str, Any]] | None:
        """The input items the response was made from; None for a response stored without them."""
        raw = await self._redis.hget(self._names.response(request_id), INPUT)
        if raw is None:
            return None
        items = orjson.loads(raw)
        return items if isinstance(items, list) else None

    async def load(self, request_id: str) -> tuple[ResponseRecord, bool] | None:
        """The record and whether a cancel was accepted; None when there is no such response."""
        raw = await self._redis.hmget(self._names.response(request_id), [RECORD, CANCELLED])
        if raw[0] is None:
            return None
        return ResponseRecord.model_validate_json(raw[0]), raw[1] is not None

    async def cancel(self, record: ResponseRecord) -> str:
        rid = record.request_id
        chunk = ErrorChunk(
            request_id=rid, seq=0, code=ErrorCode.CANCELLED, message="the response was cancelled"
        )
        keys = cancel_keys(self._names, rid)
        args: list[str | bytes | int] = [
            CANCEL_MARK_TTL_MS,
            encode(chunk),
            self._ttl_ms(record),
            self._publish,
            f"{time.time():.3f}",
        ]
        outcome = await self._cancel(keys=keys, args=args)
        return ResponseCancel(outcome.decode() if isinstance(outcome, bytes) else str(outcome))

    async def delete(self, request_id: str) -> None:
        await self._redis.delete(self._names.response(request_id), self._names.replay(request_id))

"""A request's replay log: every chunk published for it, by sequence number, kept in Redis.

The log is written by the same script as the PUBLISH, so it holds exactly what was published, and it
is what the rest of the system trusts about a stream:
- the ingress reads it to fill a gap (chunks published while its pub/sub connection was down, or
  before a Redis restart it was disconnected through);
- the dispatcher reads it to move a request off a lost worker: the tokens delivered so far become part
  of the prompt on another worker (dispatcher.migration).

Writes are fenced on the placement record: a worker that is no longer the request's owner (it was
presumed lost and the request moved) cannot add to the log or the stream. The log lives while the
request can still run and for LOG_AFTER_END_MS after its terminal chunk; a stored response's log
(InferenceRequest.keep_log_s) until that long past the request's deadline.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from queue_schemas.codec import decode_stream_event
from queue_schemas.errors import SchemaError
from queue_schemas.messages import ErrorChunk, FinalChunk, StreamEvent, TokenChunk
from queue_schemas.names import Names

LOG_AFTER_END_MS = 120_000
MIN_LOG_TTL_MS = 60_000


def log_ttl_ms(deadline: float, now: float, terminal: bool, keep_s: int = 0) -> int:
    """How long the log is kept after this write: past the request's deadline while it runs (it may
    still move), a couple of minutes once it has ended (for an ingress catching up). A stored response's
    log (`keep_s` > 0) is kept until `keep_s` past the deadline, running or ended: the response record
    beside it expires then too."""
    if keep_s > 0:
        return max(MIN_LOG_TTL_MS, int((deadline - now + keep_s) * 1000))
    if terminal:
        return LOG_AFTER_END_MS
    return max(MIN_LOG_TTL_MS, int((deadline - now) * 1000) + LOG_AFTER_END_MS)


def in_order(raw: dict[bytes, bytes], from_seq: int = 0) -> list[StreamEvent]:
    """The logged chunks from `from_seq` on, in order, up to the first one missing or unreadable; none
    after a terminal chunk."""
    found: list[StreamEvent] = []
    seq = from_seq
    while (payload := raw.get(str(seq).encode())) is not None:
        try:
            event = decode_stream_event(payload)
        except SchemaError:
            break
        found.append(event)
        if not isinstance(event, TokenChunk):
            break
        seq += 1
    return found


async def read_log(
    redis: aioredis.Redis, names: Names, request_id: str, from_seq: int = 0
) -> list[StreamEvent]:
    """The request's chunks from `from_seq` on, in order, as far as the log is unbroken."""
    raw = await redis.hgetall(names.replay(request_id))
    return in_order({_as_bytes(k): _as_bytes(v) for k, v in raw.items()}, from_seq)


def _as_bytes(value: bytes | str) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


def is_terminal(event: StreamEvent) -> bool:
    return isinstance(event, FinalChunk | ErrorChunk)

"""Chat and completion streams that outlive their connection.

Every SSE event of a streamed completion carries an `id:`, its number in the stream (0 for the opening
role event). The events are a function of the request's chunks in order (its replay log,
plumbing.replay), so they can be made again: a client that lost its connection asks for the stream at
`GET /v1/chat/completions/{id}/stream` (or `/v1/completions/...`) through any ingress, with the last id it
saw in `Last-Event-ID` (what a browser's EventSource sends by itself) or `?after=`, and gets every event
after it once, then the live ones.

What the events are made from besides the chunks is kept in Redis as a `StreamRecord` beside the log, with
a token for clients that cannot send an Authorization header (a browser's EventSource): the stream's URL
with `?token=` reads that one stream. Otherwise the caller's key must be of the request's team; another
team's stream is a 404, the same as one that does not exist.

A dropped client's request is cancelled only after its pool's `resume_grace_s`, and only if no reader is
connected then and none came back meanwhile (`cancel_after_grace`).
"""

from __future__ import annotations

import hmac
import secrets
from typing import Literal

import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict, Field
from sse_starlette import ServerSentEvent

from openai_api.structured import ToolCallPlan
from queue_schemas.names import Names

STREAM_PATH = "/v1/{kind}/{completion_id}/stream"
ROUTE_KINDS = {"chat": "chat/completions", "text": "completions"}
PREFIX = {"chat": "chatcmpl-", "text": "cmpl-"}
RETRY_MS = 1000  # what a reconnecting EventSource waits before it tries again
# The response header naming where a stream is read again (with its token), for a browser's EventSource.
STREAM_HEADER = "x-sluice-stream"


class Ping(ServerSentEvent):
    """The keep-alive of a stream whose events have ids: a comment line alone, never an empty event. A
    client keeps the last id it saw across events, and some (OpenAI's Python client among them) turn a
    blank line after a comment into an event with no data, which they cannot parse."""

    def encode(self) -> bytes:
        return b": ping\r\n"


class StreamRecord(BaseModel):
    """What a stream's events are made from besides its chunks, and who may read it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    request_id: str
    team: str
    pool: str
    kind: Literal["chat", "text"]
    model: str
    created: int
    deadline: float
    include_usage: bool = False
    tool: ToolCallPlan | None = None
    token: str = Field(min_length=32, max_length=64)

    @property
    def completion_id(self) -> str:
        return PREFIX[self.kind] + self.request_id

    def path(self) -> str:
        """Where the stream is read again, with its token."""
        route = STREAM_PATH.format(kind=ROUTE_KINDS[self.kind], completion_id=self.completion_id)
        return f"{route}?token={self.token}"


def new_token() -> str:
    return secrets.token_urlsafe(32)


def token_matches(record: StreamRecord, token: str) -> bool:
    return hmac.compare_digest(record.token.encode(), token.encode())


def request_id_of(completion_id: str, kind: Literal["chat", "text"]) -> str | None:
    """The request id in a completion id (`chatcmpl-<32 hex>`, or the bare id); None if not one. Pure."""
    rid = completion_id.removeprefix(PREFIX[kind])
    if len(rid) != 32 or any(c not in "0123456789abcdef" for c in rid):
        return None
    return rid


def last_event_id(header: str | None, after: int | None) -> int | None:
    """The last event a reconnecting client saw: `Last-Event-ID` (sent by EventSource on reconnecting)
    over `?after=`; -1 for none; None for a header that is no event id of ours. Pure."""
    if header is not None and header.strip():
        value = header.strip()
        return int(value) if value.isascii() and value.isdigit() and len(value) < 10 else None
    return -1 if after is None else after


def numbered(payloads: list[str], first: int, after: int) -> bytes:
    """SSE frames for `payloads`, numbered from `first`, those after `after` only, as one write; event 0
    also tells an EventSource how soon to come back after a drop. Pure."""
    return b"".join(
        sse_frame(payload, str(n), RETRY_MS if n == 0 else None)
        for n, payload in enumerate(payloads, start=first)
        if n > after
    )


def sse_frame(payload: str, event_id: str | None = None, retry: int | None = None) -> bytes:
    """One SSE event, byte for byte what sse-starlette writes for it (CRLF line ends), made without its
    per-event encoder: payloads are one-line JSON or `[DONE]`. Pure."""
    if "\n" in payload or "\r" in payload:  # never from the formatter; encoded the general way
        return ServerSentEvent(payload, id=event_id, retry=retry).encode()
    head = "" if event_id is None else f"id: {event_id}\r\n"
    tail = "" if retry is None else f"retry: {retry}\r\n"
    return f"{head}data: {payload}\r\n{tail}\r\n".encode()


LIVE, EPOCH = "live", "epoch"


def cancel_after_grace(live: int, epoch: int, epoch_at_leave: int) -> bool:
    """Whether a request whose reader left is cancelled at the end of the grace period: no reader is
    connected and none came back since. Pure."""
    return live <= 0 and epoch == epoch_at_leave


class StreamStore:
    """Stream records and their readers in Redis, in the request's slot. Readers: `live` counts those
    connected (the request's own first reader included), `epoch` those that came back."""

    def __init__(self, redis: aioredis.Redis, names: Names) -> None:
        self._redis = redis
        self._names = names

    async def save(self, record: StreamRecord, ttl_ms: int) -> None:
        """The record, and its first reader (the request's own response) counted as connected."""
        readers = self._names.stream_readers(record.request_id)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.set(self._names.stream_record(record.request_id), record.model_dump_json(), px=ttl_ms)
            pipe.hset(readers, mapping={LIVE: 1, EPOCH: 0})
            pipe.pexpire(readers, ttl_ms)
            await pipe.execute()

    async def load(self, request_id: str) -> StreamRecord | None:
        raw = await self._redis.get(self._names.stream_record(request_id))
        return None if raw is None else StreamRecord.model_validate_json(raw)

    async def attach(self, request_id: str) -> None:
        """A reader came back."""
        key = self._names.stream_readers(request_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hincrby(key, LIVE, 1)
            pipe.hincrby(key, EPOCH, 1)
            await pipe.execute()

    async def leave(self, request_id: str) -> int:
        """A reader went away before the end: the epoch as it left."""
        key = self._names.stream_readers(request_id)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hincrby(key, LIVE, -1)
            pipe.hget(key, EPOCH)
            _, epoch = await pipe.execute()
        return int(epoch or 0)

    async def readers(self, request_id: str) -> tuple[int, int]:
        """(connected readers, readers that came back so far)."""
        live, epoch = await self._redis.hmget(self._names.stream_readers(request_id), [LIVE, EPOCH])
        return int(live or 0), int(epoch or 0)

    async def ended(self, request_id: str, keep_ms: int) -> None:
        """The request ended: its record goes when its log does."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.pexpire(self._names.stream_record(request_id), keep_ms)
            pipe.pexpire(self._names.stream_readers(request_id), keep_ms)
            await pipe.execute()

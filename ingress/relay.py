"""Relay a request's chunks from its Redis channel to the client, as SSE events or one JSON body.

Whatever happens, the client gets exactly one terminal event: a final chunk, or an error. Chunks are
relayed in sequence order, each once: a repeated one is dropped, and a gap (chunks published while the
pub/sub connection was down) is filled from the request's replay log before the stream goes on. Once a
request has moved to another worker (its MoveMark, a chunk of the newer epoch, or its moves in the log
were seen), a live chunk of an older epoch than the one that owns its seq is a lost worker's late
write and is dropped (`EpochFence`; plumbing.replay). What the log gives is taken as it is: its reader
already took each seq from the epoch that owns it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson
import structlog
from redis.exceptions import RedisError

from ingress.streams import RESYNC, HubDisconnected, Subscription
from ingress.tracing import Relay
from openai_api.errors import from_bus_error
from openai_api.openai_types import ResponseShape
from openai_api.structured import ToolCallPlan, completion_body, parse_tool_call, tool_finish
from plumbing.replay import LogState
from queue_schemas.codec import decode_channel_message
from queue_schemas.errors import ErrorCode, SchemaError
from queue_schemas.messages import (
    ErrorChunk,
    FinalChunk,
    InferenceRequest,
    MoveMark,
    StreamEvent,
    TokenChunk,
)

log = structlog.get_logger("sluice.ingress.relay")


class Streamed(Protocol):
    """What a stream is read for: its request's id and deadline (a request, or a stored response)."""

    @property
    def request_id(self) -> str: ...

    @property
    def deadline(self) -> float: ...


# Reads a request's replay log from a sequence number on: (request id, seq) -> chunks in order, and the
# request's moves.
LogReader = Callable[[str, int], Awaitable[LogState]]


class EpochFence:
    """Which writer epoch owns each seq of a stream, as far as its relay has learned. Pure."""

    def __init__(self) -> None:
        self._begins: dict[int, int] = {}  # epoch -> the first seq it owns (a bound, until its mark)

    def moved(self, epoch: int, seq: int) -> None:
        """A move's mark, or the moves read from the log: `epoch` owns the seqs from `seq` on."""
        self._begins[epoch] = seq

    def learn(self, moves: Sequence[int]) -> None:
        for epoch, seq in enumerate(moves, start=1):
            self.moved(epoch, seq)

    def stale(self, event: StreamEvent) -> bool:
        """Whether a live chunk was written by a worker its request has moved off: its epoch is older
        than the one that owns its seq. A chunk of an epoch not yet known shows that epoch had begun by
        its seq. The control plane's chunks (no epoch) speak for whichever epoch the request is at."""
        epoch = event.epoch
        if epoch is None or not (epoch or self._begins):  # the control plane's, or never moved
            return False
        if epoch and event.seq < self._begins.get(epoch, event.seq + 1):
            self._begins[epoch] = event.seq
        owner = max((e for e, begins in self._begins.items() if begins <= event.seq), default=0)
        return epoch < owner


class Flush:
    """Marks where `marked_events` is about to wait: what was made from the events before it goes out."""


FLUSH = Flush()


async def events(
    sub: Subscription, request: Streamed, read_log: LogReader, *, quiet_disconnect: bool = False
) -> AsyncIterator[StreamEvent]:
    """Yield the request's chunks in order; always end with a FinalChunk or an ErrorChunk, except
    with `quiet_disconnect` when the stream relay is lost: then it just ends (the request runs on, and
    its reader can come back for the rest)."""
    async for item in marked_events(sub, request, read_log, quiet_disconnect=quiet_disconnect):
        if not isinstance(item, Flush):
            yield item


async def marked_events(
    sub: Subscription, request: Streamed, read_log: LogReader, *, quiet_disconnect: bool = False
) -> AsyncIterator[StreamEvent | Flush]:
    """`events`, with FLUSH yielded each time nothing more is at hand: before waiting for the next
    message, and before reading the log. A writer that sends at each FLUSH sends the events that came
    together in one write, and never holds one back while it waits."""
    expected_seq = 0
    fence = EpochFence()
    backlog: deque[StreamEvent] = deque()
    while True:
        if backlog:
            event = backlog.popleft()
        else:
            if not sub.ready():
                yield FLUSH
            try:
                if time.time() >= request.deadline:
                    raise TimeoutError
                item = await sub.next(request.deadline)
                if item == RESYNC:  # the connection was lost and is back: catch up from the log
                    yield FLUSH
                    backlog.extend(await _catch_up(read_log, request, expected_seq, fence))
                    continue
                message = decode_channel_message(item)
                if isinstance(message, MoveMark):
                    fence.moved(message.epoch, message.seq)
                    continue
                if fence.stale(message):
                    continue  # written by a worker the request has since moved off
                event = message
            except TimeoutError:
                yield _error(
                    request,
                    expected_seq,
                    ErrorCode.TIMEOUT,
                    "The request did not finish before its deadline.",
                )
                return
            except HubDisconnected as exc:
                if quiet_disconnect:
                    return
                yield _error(request, expected_seq, ErrorCode.WORKER_LOST, str(exc))
                return
            except SchemaError as exc:
                yield _error(request, expected_seq, ErrorCode.ENGINE_ERROR, f"undecodable chunk: {exc}")
                return
        if isinstance(event, ErrorChunk):
            # An error ends the stream whatever its seq: a dispatcher that answers for a lost worker's
            # request may not know how many chunks the client already has.
            yield event
            return
        if event.seq < expected_seq:
            continue  # already relayed (seen live and again in the log)
        if event.seq > expected_seq:
            yield FLUSH
            missed = await _catch_up(read_log, request, expected_seq, fence)
            if not missed:
                yield _error(
                    request,
                    expected_seq,
                    ErrorCode.WORKER_LOST,
                    f"chunk {event.seq} arrived, {expected_seq} expected, and the log does not have it",
                )
                return
            backlog.extend(missed)
            backlog.append(event)  # dropped as a repeat if the log held it too
            continue
        expected_seq += 1
        yield event
        if not isinstance(event, TokenChunk):
            return


async def _catch_up(
    read_log: LogReader, request: Streamed, from_seq: int, fence: EpochFence
) -> list[StreamEvent]:
    """The logged chunks from `from_seq` on (the fence learns the request's moves); none if the log
    cannot be read now."""
    try:
        state = await read_log(request.request_id, from_seq)
        fence.learn(state.moves)
        return state.events
    except (RedisError, OSError) as exc:
        log.warning("replay log not readable", request_id=request.request_id, error=str(exc))
        return []


class LocalError(ErrorChunk):
    """An error this ingress made itself (a deadline passed, the relay lost): no part of the request's log,
    so a stream read again elsewhere does not have it."""


def _error(request: Streamed, seq: int, code: str, message: str) -> ErrorChunk:
    return LocalError(request_id=request.request_id, seq=seq, code=code, message=message)


def _dump(body: dict[str, Any]) -> str:
    return orjson.dumps(body).decode()


@dataclass
class SseFormatter:
    """Turns bus events into OpenAI stream payloads with a consistent id/created/model.

    With a tool call forced, a named function's arguments stream as tool-call deltas as they come; when
    the model picks the function, the output is held until it is complete and sent as one call.
    """

    shape: ResponseShape
    include_usage: bool
    tool: ToolCallPlan | None = None
    _held: list[str] = field(default_factory=list)
    _called: bool = False

    def opening(self) -> list[str]:
        """Chat streams open with the assistant role; text completions have no opening chunk."""
        if self.shape.kind == "chat":
            return [_dump(self.shape.chunk(None, None, self.include_usage))]
        return []

    def format(self, event: StreamEvent) -> list[str]:
        if isinstance(event, ErrorChunk):
            return [_dump(from_bus_error(event.code, event.message).body())]
        out = self._tool_deltas(event) if self.tool is not None else self._text_deltas(event)
        if isinstance(event, FinalChunk):
            reason = tool_finish(event.finish_reason, self._called)
            out.append(_dump(self.shape.chunk("", reason, self.include_usage)))
            if self.include_usage:
                out.append(_dump(self.shape.usage_chunk(event.usage)))
            out.append("[DONE]")
        return out

    def _text_deltas(self, event: TokenChunk | FinalChunk) -> list[str]:
        return [_dump(self.shape.chunk(event.text, None, self.include_usage))] if event.text else []

    def _tool_deltas(self, event: TokenChunk | FinalChunk) -> list[str]:
        assert self.tool is not None
        if self.tool.name is not None:
            if not event.text:
                return []
            header = None if self._called else (self.tool.call_id, self.tool.name)
            self._called = True
            return [_dump(self.shape.tool_chunk(self.include_usage, event.text, header))]
        self._held.append(event.text)
        if not isinstance(event, FinalChunk):
            return []
        text = "".join(self._held)
        call = parse_tool_call(text, self.tool)
        if not isinstance(call, tuple):  # a plain answer, or output cut by max_tokens: text
            text = call if isinstance(call, str) else text
            return [_dump(self.shape.chunk(text, None, self.include_usage))] if text else []
        self._called = True
        return [_dump(self.shape.tool_chunk(self.include_usage, call[1], (self.tool.call_id, call[0])))]


async def collect(
    sub: Subscription,
    request: InferenceRequest,
    read_log: LogReader,
    shape: ResponseShape,
    tool: ToolCallPlan | None = None,
) -> dict[str, Any]:
    """Gather a whole completion for a non-streaming client; raise the translated error on failure."""
    parts: list[str] = []
    traced = Relay(request.request_id, request.pool)
    outcome, final = "cancelled", None
    try:
        async for event in events(sub, request, read_log):
            traced.chunk()
            if isinstance(event, ErrorChunk):
                outcome = "error"
                raise from_bus_error(event.code, event.message)
            parts.append(event.text)
            if isinstance(event, FinalChunk):
                outcome, final = "ok", event
                return completion_body(shape, "".join(parts), event.finish_reason, event.usage, tool)
    finally:
        traced.done(outcome, final)
    raise AssertionError("events() always ends with a terminal chunk")

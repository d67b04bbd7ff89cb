"""Relay a request's chunks from its Redis channel to the client, as SSE events or one JSON body.

Whatever happens, the client gets exactly one terminal event: a final chunk, or an error.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from ingress.errors import from_bus_error
from ingress.openai_types import chunk_body, completion_body, usage_chunk_body
from ingress.streams import HubDisconnected, Subscription
from queue_schemas.codec import decode_stream_event
from queue_schemas.errors import ErrorCode, SchemaError
from queue_schemas.messages import ErrorChunk, FinalChunk, InferenceRequest, StreamEvent, TokenChunk


async def events(sub: Subscription, request: InferenceRequest) -> AsyncIterator[StreamEvent]:
    """Yield the request's chunks in order; always end with a FinalChunk or an ErrorChunk."""
    expected_seq = 0
    while True:
        remaining = request.deadline - time.time()
        try:
            if remaining <= 0:
                raise TimeoutError
            event = decode_stream_event(await sub.next(remaining))
        except TimeoutError:
            yield _error(
                request, expected_seq, ErrorCode.TIMEOUT, "The request did not finish before its deadline."
            )
            return
        except HubDisconnected as exc:
            yield _error(request, expected_seq, ErrorCode.WORKER_LOST, str(exc))
            return
        except SchemaError as exc:
            yield _error(request, expected_seq, ErrorCode.ENGINE_ERROR, f"undecodable chunk: {exc}")
            return
        if event.seq != expected_seq:
            yield _error(
                request,
                expected_seq,
                ErrorCode.WORKER_LOST,
                f"chunk {event.seq} arrived, {expected_seq} expected",
            )
            return
        expected_seq += 1
        yield event
        if not isinstance(event, TokenChunk):
            return


def _error(request: InferenceRequest, seq: int, code: str, message: str) -> ErrorChunk:
    return ErrorChunk(request_id=request.request_id, seq=seq, code=code, message=message)


@dataclass
class SseFormatter:
    """Turns bus events into OpenAI chat.completion.chunk payloads with a consistent id/created/model."""

    completion_id: str
    created: int
    model: str
    include_usage: bool
    sent_role: bool = field(default=False)

    def _chunk(self, delta: dict[str, Any], finish: Any = None) -> str:
        body = chunk_body(self.completion_id, self.created, self.model, delta, finish, self.include_usage)
        return json.dumps(body, separators=(",", ":"))

    def first(self) -> str:
        self.sent_role = True
        return self._chunk({"role": "assistant", "content": ""})

    def format(self, event: StreamEvent) -> list[str]:
        if isinstance(event, ErrorChunk):
            err = from_bus_error(event.code, event.message)
            return [json.dumps(err.body(), separators=(",", ":"))]
        out: list[str] = []
        if event.text:
            out.append(self._chunk({"content": event.text}))
        if isinstance(event, FinalChunk):
            out.append(self._chunk({}, event.finish_reason.value))
            if self.include_usage:
                body = usage_chunk_body(self.completion_id, self.created, self.model, event.usage)
                out.append(json.dumps(body, separators=(",", ":")))
            out.append("[DONE]")
        return out


async def collect(sub: Subscription, request: InferenceRequest, completion_id: str) -> dict[str, Any]:
    """Gather a whole completion for a non-streaming client; raise the translated error on failure."""
    parts: list[str] = []
    async for event in events(sub, request):
        if isinstance(event, ErrorChunk):
            raise from_bus_error(event.code, event.message)
        parts.append(event.text)
        if isinstance(event, FinalChunk):
            created = int(request.created_at)
            return completion_body(
                completion_id, created, request.model, "".join(parts), event.finish_reason, event.usage
            )
    raise AssertionError("events() always ends with a terminal chunk")

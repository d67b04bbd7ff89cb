"""A stored response, and the Responses API events and objects made from its request's chunks. Pure.

The events of a response are a function of its record and its request's chunks in order (the replay
log, plumbing.replay): `ResponseEvents` numbers them from 0 as it goes, so a client that lost its
connection after event N and asks for the stream again from any ingress is sent the same events from
N + 1 on, made again from the log and then from the live stream. Nothing per event is stored.

Event order, as OpenAI documents it: `response.created` (and `response.in_progress`, at once for a
foreground response, at its first output for a background one, which is `queued` until then); per
output item `response.output_item.added`, then for a message `response.content_part.added`,
`response.output_text.delta`..., `response.output_text.done`, `response.content_part.done`, or for a
function call `response.function_call_arguments.delta`..., `.done`; `response.output_item.done`; and
one terminal event: `response.completed`, `response.incomplete` (cut by max_output_tokens) or
`response.failed` (an error, or a cancellation: its response's status says `cancelled`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from openai_api.structured import ToolCallPlan, parse_tool_call
from queue_schemas.errors import ErrorCode
from queue_schemas.messages import ErrorChunk, FinalChunk, FinishReason, StreamEvent, Usage

Status = Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]


class ResponseRecord(BaseModel):
    """What is kept of a response besides its request's chunks: who owns it, and what it echoes back."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    request_id: str
    team: str
    model: str
    created_at: float
    deadline: float
    prompt_tokens: int = Field(ge=0)
    background: bool = False
    tool: ToolCallPlan | None = Field(default=None, description="how a tool call is shaped back")
    echo: dict[str, Any] = Field(
        default_factory=dict,
        description="request fields the response object repeats: instructions, tools, text, metadata...",
    )

    @property
    def response_id(self) -> str:
        return f"resp_{self.request_id}"


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }


def error_body(code: str, message: str) -> dict[str, Any]:
    shown = "server_error" if code in (ErrorCode.ENGINE_ERROR, ErrorCode.WORKER_LOST) else code
    return {"code": shown, "message": message}


@dataclass
class ResponseEvents:
    """Feeds a response's chunks in order; gives its events (numbered) and its object at any point."""

    record: ResponseRecord
    seq: int = 0
    status: Status = "queued"
    output: list[dict[str, Any]] = field(default_factory=list)
    usage: Usage | None = None
    error: dict[str, Any] | None = None
    incomplete: dict[str, Any] | None = None
    completed_at: float | None = None
    _text: list[str] = field(default_factory=list)
    _open: dict[str, Any] | None = None  # the output item being streamed
    _output_tokens: int = 0
    _started: bool = False

    def __post_init__(self) -> None:
        self.status = "queued" if self.record.background else "in_progress"

    # events
    def opening(self) -> list[dict[str, Any]]:
        out = [self._event("response.created", response=self.body())]
        if not self.record.background:
            out.append(self._event("response.in_progress", response=self.body()))
        return out

    def feed(self, chunk: StreamEvent) -> list[dict[str, Any]]:
        """The events one chunk makes; a chunk after the terminal one makes none."""
        if self.status not in ("queued", "in_progress"):
            return []
        out: list[dict[str, Any]] = []
        if self.status == "queued" and not isinstance(chunk, ErrorChunk):
            self.status = "in_progress"
            out.append(self._event("response.in_progress", response=self.body()))
        if isinstance(chunk, ErrorChunk):
            return out + self._fail(chunk)
        self._started = True
        self._output_tokens += chunk.num_tokens
        tool = self.record.tool
        if tool is None:
            out += self._text_delta(chunk.text)
        elif tool.name is not None:
            out += self._arguments_delta(tool, chunk.text)
        else:
            self._text.append(chunk.text)  # the model picks: held until the answer is whole
        if isinstance(chunk, FinalChunk):
            out += self._finish(chunk)
        return out

    def _text_delta(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        out = self._open_message() if self._open is None else []
        self._text.append(text)
        return [*out, self._event("response.output_text.delta", **self._where(), delta=text, logprobs=[])]

    def _arguments_delta(self, tool: ToolCallPlan, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        assert tool.name is not None
        out = self._open_call(tool.call_id, tool.name) if self._open is None else []
        self._text.append(text)
        return [*out, self._event("response.function_call_arguments.delta", **self._where(), delta=text)]

    def _open_message(self) -> list[dict[str, Any]]:
        item = {
            "id": f"msg_{self.record.request_id}", "type": "message", "status": "in_progress",
            "role": "assistant", "content": [],
        }  # fmt: skip
        self._open = item
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self._event("response.output_item.added", output_index=0, item=dict(item)),
            self._event("response.content_part.added", **self._where(), part=part),
        ]

    def _open_call(self, call_id: str, name: str) -> list[dict[str, Any]]:
        item = {
            "id": f"fc_{self.record.request_id}", "type": "function_call", "status": "in_progress",
            "call_id": call_id, "name": name, "arguments": "",
        }  # fmt: skip
        self._open = item
        return [self._event("response.output_item.added", output_index=0, item=dict(item))]

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        where: dict[str, Any] = {"item_id": self._open["id"], "output_index": 0}
        if self._open["type"] == "message":
            where["content_index"] = 0
        return where

    def _close(self, status: str) -> list[dict[str, Any]]:
        """Close the open output item with its whole text."""
        assert self._open is not None
        text = "".join(self._text)
        item = dict(self._open)
        item["status"] = status
        if item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            item["content"] = [part]
            out = [
                self._event("response.output_text.done", **self._where(), text=text, logprobs=[]),
                self._event("response.content_part.done", **self._where(), part=part),
            ]
        else:
            item["arguments"] = text
            done = "response.function_call_arguments.done"
            out = [self._event(done, **self._where(), name=item["name"], arguments=text)]
        self._open = item
        self.output = [item]
        return [*out, self._event("response.output_item.done", output_index=0, item=item)]

    def _finish(self, chunk: FinalChunk) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        tool = self.record.tool
        if tool is not None and tool.name is None:
            text = "".join(self._text)
            call = parse_tool_call(text, tool)
            self._text = []
            if isinstance(call, tuple):
                out += self._open_call(tool.call_id, call[0])
                self._text = [call[1]]
                out.append(
                    self._event("response.function_call_arguments.delta", **self._where(), delta=call[1])
                )
            else:  # a plain answer, or output cut by max_output_tokens: text
                out += self._text_delta(call if isinstance(call, str) else text)
        if self._open is None:
            out += self._open_message()  # an empty answer is still one (empty) message
        cut = chunk.finish_reason is FinishReason.LENGTH
        out += self._close("incomplete" if cut else "completed")
        self.usage = chunk.usage
        self.completed_at = None if cut else chunk.ended_at
        if cut:
            self.status = "incomplete"
            self.incomplete = {"reason": "max_output_tokens"}
            return [*out, self._event("response.incomplete", response=self.body())]
        self.status = "completed"
        return [*out, self._event("response.completed", response=self.body())]

    def _fail(self, chunk: ErrorChunk) -> list[dict[str, Any]]:
        out = self._close("incomplete") if self._open is not None else []
        prompt = self.record.prompt_tokens if self._started else 0
        self.usage = Usage(prompt_tokens=prompt, completion_tokens=self._output_tokens)
        if chunk.code == ErrorCode.CANCELLED:
            self.status = "cancelled"
        else:
            self.status = "failed"
            self.error = error_body(chunk.code, chunk.message)
        return [*out, self._event("response.failed", response=self.body())]

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    # the object
    def body(self, status: Status | None = None) -> dict[str, Any]:
        """The response object now; `status` overrides what the chunks so far show (see shown_status)."""
        rec = self.record
        shown = status or self.status
        output = self.output
        if self._open is not None and self._open.get("status") == "in_progress":
            output = [self._partial()]
        return {
            "id": rec.response_id,
            "object": "response",
            "created_at": int(rec.created_at),
            "completed_at": None if self.completed_at is None else int(self.completed_at),
            "status": shown,
            "background": rec.background,
            "error": self.error,
            "incomplete_details": self.incomplete,
            "model": rec.model,
            "output": output,
            "parallel_tool_calls": rec.echo.get("parallel_tool_calls", True),
            "previous_response_id": rec.echo.get("previous_response_id"),
            "store": rec.echo.get("store", True),
            "tool_choice": rec.echo.get("tool_choice", "auto"),
            "tools": rec.echo.get("tools", []),
            "text": rec.echo.get("text", {"format": {"type": "text"}}),
            "truncation": "disabled",
            "usage": usage_body(self.usage) if self.usage is not None else None,
            **{k: rec.echo.get(k) for k in ECHOED},
        }

    def _partial(self) -> dict[str, Any]:
        assert self._open is not None
        item = dict(self._open)
        text = "".join(self._text)
        if item["type"] == "message":
            item["content"] = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        else:
            item["arguments"] = text
        return item


ECHOED = ("instructions", "max_output_tokens", "metadata", "service_tier", "temperature", "top_p", "user")


def replayed(record: ResponseRecord, chunks: list[StreamEvent]) -> ResponseEvents:
    """The response after these chunks (its events made and dropped): what a retrieve shows."""
    events = ResponseEvents(record)
    events.opening()
    for chunk in chunks:
        events.feed(chunk)
    return events


def shown_status(events: ResponseEvents, cancelled: bool, now: float) -> Status | None:
    """What a retrieve reports beyond the chunks: `cancelled` once a cancel was accepted and the
    engine's own report is not in yet, `failed` for one past its deadline with no answer; else None."""
    if events.status in ("queued", "in_progress"):
        if cancelled:
            return "cancelled"
        if now > events.record.deadline:
            events.error = error_body(ErrorCode.TIMEOUT, "The response did not finish before its deadline.")
            return "failed"
    return None


def unseen(events: list[dict[str, Any]], after: int) -> list[dict[str, Any]]:
    """The events after sequence number `after` (a resumed stream's first), in order."""
    return [e for e in events if e["sequence_number"] > after]

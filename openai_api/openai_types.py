"""The OpenAI request bodies as clients send them, and the response shapes ingress emits."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from queue_schemas.messages import SEED_MAX, SEED_MIN, FinishReason, Tier, Usage


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=FUNCTION_NAME)
    arguments: str = Field(description="the arguments as a JSON text, as the model produced them")


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, max_length=128)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(default=None, validate_default=True)
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = Field(default=None, min_length=1)

    @field_validator("content")
    @classmethod
    def _content_present(cls, content: str | list[TextPart] | None, info: ValidationInfo) -> object:
        # As in OpenAI's API: only an assistant message (calling tools) may leave its content null.
        role = info.data.get("role")
        if content is None and role != "assistant":
            raise ValueError(f"a {role} message must have content")
        return content

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates expect it: content flattened to a string."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in self.tool_calls
            ]
        return out


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]


class JsonObjectFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["json_object"]


class JsonSchemaResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")
]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class GenerationFields(BaseModel):
    """Fields both endpoints share. Unknown fields are refused (400 naming the field), never ignored."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    user: str | None = Field(default=None, max_length=256)
    n: Literal[1] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    service_tier: Literal["auto", "default", "flex", "priority"] | None = Field(
        default=None,
        description="priority runs ahead of default and flex traffic (if the key allows it); flex behind",
    )

    def stop_sequences(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(s for s in self.stop if s)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def tier(self) -> Tier:
        """The requested tier; `auto` and no value are the default tier."""
        if self.service_tier in (None, "auto"):
            return Tier.DEFAULT
        return Tier(self.service_tier)

    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(GenerationFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(GenerationFields):
    """`POST /v1/completions`: one prompt string (or a list holding exactly one)."""

    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: Literal[False] | None = None
    best_of: Literal[1] | None = None
    suffix: None = None

    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def tool_call_body(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


class ResponseShape:
    """Chat (`chat.completion[.chunk]`, delta/message) or text (`text_completion`, text) bodies."""

    def __init__(self, kind: Literal["chat", "text"], completion_id: str, created: int, model: str) -> None:
        self.kind = kind
        self.completion_id = completion_id
        self.created = created
        self.model = model

    def tool_chunk(
        self, include_usage: bool, arguments: str, header: tuple[str, str] | None = None
    ) -> dict[str, Any]:
        """A streamed tool-call delta: the first carries (call id, function name), later ones only
        argument fragments, as the official clients reassemble them."""
        call: dict[str, Any] = {"index": 0, "function": {"arguments": arguments}}
        if header is not None:
            call = {"index": 0, **tool_call_body(header[0], header[1], arguments)}
        choice = {"index": 0, "delta": {"tool_calls": [call]}, "logprobs": None, "finish_reason": None}
        body = self._envelope("chat.completion.chunk", [choice])
        if include_usage:
            body["usage"] = None
        return body

    def complete_tool_call(
        self, call: dict[str, Any], finish_reason: FinishReason, usage: Usage
    ) -> dict[str, Any]:
        message = {"role": "assistant", "content": None, "refusal": None, "tool_calls": [call]}
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
        return {**self._envelope("chat.completion", [choice]), "usage": usage_body(usage)}

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.completion_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }

    def chunk(
        self, text: str | None, finish_reason: FinishReason | None, include_usage: bool
    ) -> dict[str, Any]:
        """One streamed choice chunk; for chat, `text=None` makes the opening role delta."""
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if text is None else {}
            if text:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            body = self._envelope("chat.completion.chunk", [choice])
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            body = self._envelope("text_completion", [choice])
        if include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._envelope(obj, []), "usage": usage_body(usage)}

    def complete(self, text: str, finish_reason: FinishReason, usage: Usage) -> dict[str, Any]:
        if self.kind == "chat":
            message = {"role": "assistant", "content": text, "refusal": None}
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
            body = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            body = self._envelope("text_completion", [choice])
        return {**body, "usage": usage_body(usage)}

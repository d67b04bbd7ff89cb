"""`POST /v1/responses` as clients send it, what of it is served, and how it maps onto a chat request.

A Responses request is translated into a ChatCompletionRequest (instructions become the system
message, input items become messages, `text.format` becomes `response_format`, flat function tools
become chat tools), so it travels the same admission, quota, placement and engine path. Pure.

Served: text input (a string, or messages with text parts), `instructions`, function tools with
`tool_choice`, earlier function calls and their outputs as input items, `text.format` (text, JSON object,
JSON schema), `max_output_tokens`, `temperature`, `top_p`, `service_tier`, `metadata`, `store`,
`background` and `stream`, and `previous_response_id` (the conversation so far is the previous response's
input and output, then this input; its `instructions` are not carried over). Not served, each answered
with a 400 naming it: `conversation` (chain by `previous_response_id`, or send the whole conversation as
`input`), `prompt` templates, `reasoning`, `include`,
`truncation: auto`, `top_logprobs`, `max_tool_calls`, built-in tools (web search, file search, ...), and
image, file or audio input.
"""

from __future__ import annotations

import secrets
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter

from openai_api.errors import InvalidRequest
from openai_api.openai_types import (
    FUNCTION_NAME,
    ChatCompletionRequest,
    ChatMessage,
    FunctionCall,
    FunctionDefinition,
    JsonObjectFormat,
    JsonSchemaFormat,
    JsonSchemaResponseFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    TextFormat,
    Tool,
    ToolCall,
)

# Fields of OpenAI's request that this server does not serve, with what to do instead. Sent with a
# value other than null (or an empty list or object, or 0), each is a 400 naming it.
NOT_SERVED: dict[str, str] = {
    "conversation": "Chain responses with previous_response_id, or send the whole conversation as `input`.",
    "prompt": "Prompt templates are not stored here; send the text as `input`.",
    "reasoning": "The served models have no reasoning settings.",
    "include": "No extra output (such as logprobs or reasoning content) can be included.",
    "top_logprobs": "Log probabilities are not returned.",
    "max_tool_calls": "Built-in tools are not served, so there are no calls to limit.",
    "context_management": "Context is not managed by the server; send what the model should see.",
}
NOT_SERVED_PARTS = {"input_image", "input_file", "input_audio"}
MAX_METADATA_KEYS = 16


class InputText(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["input_text"]
    text: str


class OutputText(BaseModel):
    """Text the model produced earlier (an assistant message of a previous response's output)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


ContentPart = Annotated[InputText | OutputText, Field(discriminator="type")]


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = Field(default=None, max_length=128)
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(BaseModel):
    """A call the model made in an earlier turn, sent back with its output."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=128)
    name: str = Field(pattern=FUNCTION_NAME)
    arguments: str
    id: str | None = Field(default=None, max_length=128)
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=128)
    output: str
    id: str | None = Field(default=None, max_length=128)
    status: Literal["in_progress", "completed", "incomplete"] | None = None


def _item_type(item: Any) -> str:
    """An input item's type; a message may leave it out."""
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", "message")
    return kind if isinstance(kind, str) else ""


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_type),
]


_ITEMS: TypeAdapter[list[InputItem]] = TypeAdapter(list[InputItem])
ITEM_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}


def stored_items(items: list[InputItem]) -> list[dict[str, Any]]:
    """Input items as a response keeps them and `input_items` lists them: OpenAI's shape, each with an id
    (its own, or a new one) and a status; a message's text as content parts. Pure but for the ids."""
    out = []
    for item in items:
        entry = item.model_dump(exclude_none=True)
        if isinstance(item, MessageItem):
            if isinstance(item.content, str):
                kind = "output_text" if item.role == "assistant" else "input_text"
                entry["content"] = [{"type": kind, "text": item.content}]
            entry["type"] = "message"
        entry.setdefault("id", f"{ITEM_PREFIX[entry['type']]}_{secrets.token_hex(16)}")
        entry.setdefault("status", "completed")
        out.append(entry)
    return out


def repeated_id(items: list[dict[str, Any]]) -> str | None:
    """An item id the conversation holds twice (OpenAI refuses those), or None. Pure."""
    seen: set[str] = set()
    for item in items:
        item_id = item.get("id")
        if isinstance(item_id, str):
            if item_id in seen:
                return item_id
            seen.add(item_id)
    return None


def parse_items(raw: Any) -> list[InputItem]:
    """Stored input items (or a response's output items) as input items again; ValueError if not."""
    return _ITEMS.validate_python(raw)


def request_items(body: ResponsesRequest) -> list[InputItem]:
    """The request's own input as items (a string is one user message)."""
    if isinstance(body.input, str):
        return [MessageItem(role="user", content=[InputText(type="input_text", text=body.input)])]
    return list(body.input)


def output_as_input(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the next turn's input: its message and function call items, as they
    were. Pure."""
    return [dict(item) for item in output if item.get("type") in ("message", "function_call")]


def page_of(
    items: list[dict[str, Any]], limit: int, order: Literal["asc", "desc"], after: str | None
) -> dict[str, Any] | None:
    """One page of a response's input items, OpenAI's list object (`after`: the id the last page ended
    at); None when `after` names no item. Pure."""
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            return None
        start = ids.index(after) + 1
    data = ordered[start : start + limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": start + limit < len(ordered),
    }


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str


class JsonSchemaTextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["json_schema"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


TextFormatParam = Annotated[TextFormat | JsonObjectFormat | JsonSchemaTextFormat, Field(discriminator="type")]


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: TextFormatParam | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_obfuscation: bool | None = Field(default=None, description="accepted; no padding is sent")


class ResponsesRequest(BaseModel):
    """The body of `POST /v1/responses`. Unknown fields are refused (400 naming the field)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    previous_response_id: str | None = Field(default=None, max_length=64)
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    background: bool = False
    store: bool = True
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    truncation: Literal["disabled"] | None = None
    user: str | None = Field(default=None, max_length=256)
    safety_identifier: str | None = Field(default=None, max_length=256)
    prompt_cache_key: str | None = Field(default=None, max_length=256)


def check_served(raw: Any) -> None:
    """A clear 400 for each part of OpenAI's API that is not served, before the body is parsed (a body
    that is not an object is left to the parser's own error)."""
    if not isinstance(raw, dict):
        return
    for name, advice in NOT_SERVED.items():
        value = raw.get(name)
        if value not in (None, [], {}, 0):  # sent empty, it asks for nothing
            raise InvalidRequest(f"'{name}' is not supported by this server. {advice}", param=name)
    if raw.get("truncation") == "auto":
        raise InvalidRequest(
            "truncation 'auto' is not supported: a prompt longer than the model's context is refused.",
            param="truncation",
        )
    tools = raw.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise InvalidRequest(f"Only function tools are served; '{kind}' is not.", param=f"tools.{i}.type")
    items = raw.get("input")
    for i, item in enumerate(items if isinstance(items, list) else []):
        content = item.get("content") if isinstance(item, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in NOT_SERVED_PARTS:
                raise InvalidRequest(
                    f"Only text input is served; '{kind}' is not.", param=f"input.{i}.content.{j}.type"
                )
        kind = item.get("type") if isinstance(item, dict) else None
        if isinstance(kind, str) and kind not in ("message", "function_call", "function_call_output"):
            raise InvalidRequest(
                f"Input items of type '{kind}' are not served; send messages, function calls and their "
                "outputs.",
                param=f"input.{i}.type",
            )
    metadata = raw.get("metadata")
    if isinstance(metadata, dict) and (
        len(metadata) > MAX_METADATA_KEYS or any(len(str(k)) > 64 for k in metadata)
    ):
        raise InvalidRequest(
            f"metadata holds at most {MAX_METADATA_KEYS} keys of at most 64 characters.", param="metadata"
        )


def messages_of(body: ResponsesRequest) -> list[ChatMessage]:
    """The conversation as chat messages: instructions first (as the system message), then the input."""
    out: list[ChatMessage] = []
    if body.instructions:
        out.append(ChatMessage(role="system", content=body.instructions))
    if isinstance(body.input, str):
        out.append(ChatMessage(role="user", content=body.input))
        return out
    for item in body.input:
        if isinstance(item, MessageItem):
            out.append(ChatMessage(role=item.role, content=item.text()))
        elif isinstance(item, FunctionCallItem):
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=item.arguments))
            if out and out[-1].role == "assistant" and out[-1].tool_calls:
                out[-1] = out[-1].model_copy(update={"tool_calls": [*out[-1].tool_calls, call]})
            else:
                out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        else:
            out.append(ChatMessage(role="tool", content=item.output, tool_call_id=item.call_id))
    return out


def _response_format(body: ResponsesRequest) -> ResponseFormat | None:
    fmt = body.text.format if body.text is not None else None
    if isinstance(fmt, JsonSchemaTextFormat):
        schema = JsonSchemaFormat(
            name=fmt.name, description=fmt.description, schema=fmt.schema_, strict=fmt.strict
        )
        return JsonSchemaResponseFormat(type="json_schema", json_schema=schema)
    return fmt


def _tool_choice(body: ResponsesRequest) -> Literal["none", "auto", "required"] | NamedToolChoice | None:
    choice = body.tool_choice
    if isinstance(choice, FunctionChoice):
        return NamedToolChoice(type="function", function=NamedFunction(name=choice.name))
    return choice


def as_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request the Responses request is served as (same model, sampling, tools and format)."""
    messages = messages_of(body)
    if not messages:
        raise InvalidRequest("The input is empty.", param="input")
    tools = [
        Tool(
            type="function",
            function=FunctionDefinition(
                name=t.name, description=t.description, parameters=t.parameters, strict=t.strict
            ),
        )
        for t in body.tools or []
    ]
    return ChatCompletionRequest(
        model=body.model,
        messages=messages,
        max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        response_format=_response_format(body),
        tools=tools or None,
        tool_choice=_tool_choice(body),
        parallel_tool_calls=body.parallel_tool_calls,
        service_tier=body.service_tier,
        user=body.user,
    )


def parse_response_id(response_id: str) -> str | None:
    """The request id inside a response id (`resp_<32 hex>`), or None when it is not one of ours."""
    rid = response_id.removeprefix("resp_")
    if rid == response_id or len(rid) != 32 or any(c not in "0123456789abcdef" for c in rid):
        return None
    return rid

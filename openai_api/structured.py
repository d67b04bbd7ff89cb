"""response_format, tools and tool_choice: checked at admission, turned into the engine's guidance.

Pure: `plan_output` decides what the engine is told (a JSON schema to follow, or any JSON object) and
how the answer is shaped back (text, or a tool call). Every problem is a 400 naming the field, before
the request is queued. `compile_check` is the engine's own schema compiler where the pool has one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jsonschema import SchemaError
from jsonschema.validators import validator_for

from openai_api.errors import InvalidRequest
from openai_api.openai_types import (
    ChatCompletionRequest,
    JsonObjectFormat,
    JsonSchemaResponseFormat,
    NamedToolChoice,
    ResponseShape,
    Tool,
    tool_call_body,
)
from queue_schemas.messages import FinishReason, StructuredOutput, Usage

# Returns why the engine cannot compile a schema (serialized), or None when it can.
CompileCheck = Callable[[str], str | None]
SCHEMA_PARAM = "response_format.json_schema.schema"
MAX_SCHEMA_BYTES = 64 * 1024  # one schema, serialized
MAX_TOTAL_SCHEMA_BYTES = 256 * 1024  # every schema of a request together
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class ToolCallPlan:
    """The answer is one tool call: of `name`, or (None) of whichever tool the model names. With `auto`
    the model may answer in text instead, as {"content": ...}."""

    call_id: str
    name: str | None
    auto: bool = False


@dataclass(frozen=True, slots=True)
class OutputPlan:
    structured: StructuredOutput | None = None
    tool: ToolCallPlan | None = None
    tools: tuple[dict[str, Any], ...] = ()  # definitions shown to the model through the chat template


def _check_schema(schema: Any, param: str, compile_check: CompileCheck | None) -> str:
    if not isinstance(schema, dict):
        raise InvalidRequest("The JSON schema must be an object.", param=param)
    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        raise InvalidRequest(f"Invalid JSON schema: {exc.message}", param=param) from None
    text = json.dumps(schema, separators=(",", ":"), sort_keys=True)
    if compile_check is not None:
        problem = compile_check(text)
        if problem is not None:
            raise InvalidRequest(f"The engine cannot compile this JSON schema: {problem}", param=param)
    return text


def _parameters(tool: Tool, index: int, compile_check: CompileCheck | None) -> dict[str, Any]:
    params = tool.function.parameters if tool.function.parameters is not None else EMPTY_PARAMETERS
    param = f"tools.{index}.function.parameters"
    if params.get("type") != "object":
        raise InvalidRequest("A function's parameters must be a JSON schema of type 'object'.", param=param)
    _check_schema(params, param, compile_check)
    return params


TEXT_ANSWER = {
    "type": "object",
    "properties": {"content": {"type": "string"}},
    "required": ["content"],
    "additionalProperties": False,
}


def _any_tool_schema(tools: list[Tool], params: list[dict[str, Any]], text: bool) -> dict[str, Any]:
    """JSON naming one of the tools and giving its arguments: {"name": ..., "arguments": {...}}; with
    `text`, a plain answer {"content": ...} is allowed too."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.function.name}, "arguments": p},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t, p in zip(tools, params, strict=True)
    ]
    return {"anyOf": [*calls, TEXT_ANSWER] if text else calls}


def check_sizes(body: ChatCompletionRequest) -> None:
    """The cheap part of the output checks, made before the quota gate: each schema's serialized size,
    and their sum, are bounded, so the expensive part (validation and compiling) is bounded too."""
    sized: list[tuple[str, Any]] = [
        (f"tools.{i}.function.parameters", t.function.parameters) for i, t in enumerate(body.tools or [])
    ]
    fmt = body.response_format
    if isinstance(fmt, JsonSchemaResponseFormat):
        sized.append((SCHEMA_PARAM, fmt.json_schema.schema_))
    total = 0
    for param, schema in sized:
        size = len(json.dumps(schema, separators=(",", ":")))
        if size > MAX_SCHEMA_BYTES:
            raise InvalidRequest(
                f"The JSON schema is {size} bytes; at most {MAX_SCHEMA_BYTES} are allowed.", param=param
            )
        total += size
    if total > MAX_TOTAL_SCHEMA_BYTES:
        raise InvalidRequest(
            f"The request's JSON schemas total {total} bytes; at most {MAX_TOTAL_SCHEMA_BYTES} are allowed.",
            param="tools" if body.tools else SCHEMA_PARAM,
        )


def tool_definitions(body: ChatCompletionRequest) -> tuple[dict[str, Any], ...]:
    """The tools as the chat template shows them to the model (needed to count the prompt's tokens)."""
    return tuple(t.model_dump(exclude_none=True) for t in body.tools or [])


def checked_param(body: ChatCompletionRequest) -> str:
    """The field a check that ran out of time is blamed on."""
    return SCHEMA_PARAM if isinstance(body.response_format, JsonSchemaResponseFormat) else "tools"


def plan_output(
    body: ChatCompletionRequest, call_id: str, compile_check: CompileCheck | None, tool_parser: bool
) -> OutputPlan:
    """What the engine must produce for this request, and how the answer is shaped back."""
    tools = body.tools or []
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequest("Function names in tools must be unique.", param="tools")
    params = [_parameters(t, i, compile_check) for i, t in enumerate(tools)]
    definitions = tool_definitions(body)
    choice = body.tool_choice
    if choice is not None and not tools:
        raise InvalidRequest("tool_choice is only allowed when tools are given.", param="tool_choice")
    forced: ToolCallPlan | None = None
    schema: dict[str, Any] | None = None
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise InvalidRequest(
                f"tool_choice names function {choice.function.name!r}, which is not in tools.",
                param="tool_choice.function.name",
            )
        forced = ToolCallPlan(call_id, choice.function.name)
        schema = params[names.index(choice.function.name)]
    elif choice == "required":
        forced = ToolCallPlan(call_id, None)
        schema = _any_tool_schema(tools, params, text=False)
    elif tools and choice in (None, "auto") and not tool_parser:
        # No parser for the model's own call syntax: guided decoding lets it answer either way.
        forced = ToolCallPlan(call_id, None, auto=True)
        schema = _any_tool_schema(tools, params, text=True)
    fmt = body.response_format
    if forced is not None:
        if isinstance(fmt, JsonObjectFormat | JsonSchemaResponseFormat):
            raise InvalidRequest(
                "response_format cannot be combined with tools unless tool_choice is 'none'.",
                param="response_format",
            )
        guided = StructuredOutput(kind="json_schema", schema_text=json.dumps(schema, separators=(",", ":")))
        return OutputPlan(guided, forced, definitions)
    if isinstance(fmt, JsonSchemaResponseFormat):
        if fmt.json_schema.schema_ is None:
            raise InvalidRequest(
                "json_schema.schema is required.", param="response_format.json_schema.schema"
            )
        text = _check_schema(fmt.json_schema.schema_, "response_format.json_schema.schema", compile_check)
        return OutputPlan(StructuredOutput(kind="json_schema", schema_text=text), None, definitions)
    if isinstance(fmt, JsonObjectFormat):
        return OutputPlan(StructuredOutput(kind="json_object"), None, definitions)
    return OutputPlan(None, None, definitions)


def preload_schema_compiler() -> bool:
    """Import the engine's schema compiler now (it takes seconds), not on the first request that needs it."""
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        return False
    return True


def xgrammar_check(schema_json: str) -> str | None:
    """The guided-decoding compiler vLLM uses: why it refuses the schema, or None. Where the engine's
    compiler is not installed beside the ingress, the engine reports a refused schema as an error event."""
    try:
        import xgrammar
    except ImportError:
        return None

    try:
        xgrammar.Grammar.from_json_schema(schema_json)
    except (RuntimeError, ValueError) as exc:
        return str(exc).strip().rsplit(": ", 1)[-1]
    return None


def parse_tool_call(text: str, plan: ToolCallPlan) -> tuple[str, str] | str | None:
    """(function name, arguments JSON) from the model's output; with `auto`, the text of a plain answer;
    None if the output is not complete (cut by max_tokens)."""
    if plan.name is not None:
        return plan.name, text
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    if plan.auto and isinstance(value.get("content"), str) and "name" not in value:
        return str(value["content"])
    if not isinstance(value.get("name"), str) or "arguments" not in value:
        return None
    return value["name"], json.dumps(value["arguments"], separators=(",", ":"))


def tool_finish(reason: FinishReason, called: bool) -> FinishReason:
    """A call the engine completed ends with `tool_calls`; a truncated one keeps `length`."""
    return FinishReason.TOOL_CALLS if called and reason is FinishReason.STOP else reason


def completion_body(
    shape: ResponseShape, text: str, finish_reason: FinishReason, usage: Usage, tool: ToolCallPlan | None
) -> dict[str, Any]:
    """The whole (non-streamed) completion for the engine's output: text, or the tool call it makes."""
    call = parse_tool_call(text, tool) if tool is not None else None
    if tool is not None and isinstance(call, tuple):
        body = tool_call_body(tool.call_id, call[0], call[1])
        return shape.complete_tool_call(body, tool_finish(finish_reason, True), usage)
    return shape.complete(call if isinstance(call, str) else text, finish_reason, usage)

"""Structured outputs and tool calls: planning at admission, the simulated engine's JSON, the reply shapes."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema import validate

from gpu_workers.json_sample import UnsupportedSchema, sample
from ingress.relay import SseFormatter
from openai_api.errors import InvalidRequest
from openai_api.openai_types import ChatCompletionRequest, ResponseShape
from openai_api.structured import ToolCallPlan, parse_tool_call, plan_output, xgrammar_check
from queue_schemas.messages import FinalChunk, FinishReason, TokenChunk, Usage

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
            "required": ["city", "days"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def body(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


def plan(check: Any = None, **fields: Any) -> Any:
    return plan_output(body(**fields), "call_1", check, tool_parser=False)


def test_plain_requests_have_no_guidance() -> None:
    p = plan()
    assert p.structured is None
    assert p.tool is None


def test_json_schema_and_json_object() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    p = plan(response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}})
    assert p.structured.kind == "json_schema"
    assert json.loads(p.structured.schema_text) == schema
    assert plan(response_format={"type": "json_object"}).structured.kind == "json_object"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
          "tool_choice": "required"}, "tools.0.function.parameters"),
        ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format"),
    ],
)  # fmt: skip
def test_bad_input_names_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        plan(**fields)
    assert err.value.param == param


def test_the_engines_compiler_is_asked_first() -> None:
    schema = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}
    with pytest.raises(InvalidRequest, match="cannot compile") as err:
        plan(
            lambda _text: "Cannot find field missing",
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        )
    assert err.value.param == "response_format.json_schema.schema"


def test_xgrammar_refuses_what_it_cannot_compile() -> None:
    assert xgrammar_check(json.dumps({"type": "object"})) is None
    assert "strung" in (xgrammar_check(json.dumps({"type": "strung"})) or "")


def test_named_and_required_tool_choice() -> None:
    named = plan(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.tool == ToolCallPlan("call_1", "get_weather")
    assert json.loads(named.structured.schema_text) == WEATHER["function"]["parameters"]  # type: ignore[index]
    required = plan(tools=[WEATHER, TIME], tool_choice="required")
    assert required.tool == ToolCallPlan("call_1", None)
    schema = json.loads(required.structured.schema_text)
    validate({"name": "get_time", "arguments": {}}, schema)
    assert len(required.tools) == 2
    assert plan(tools=[WEATHER], tool_choice="none").tool is None


def test_auto_lets_the_model_answer_in_text_or_call() -> None:
    auto = plan(tools=[WEATHER, TIME])
    assert auto.tool == ToolCallPlan("call_1", None, auto=True)
    schema = json.loads(auto.structured.schema_text)
    validate({"content": "It is sunny."}, schema)
    validate({"name": "get_time", "arguments": {}}, schema)
    assert parse_tool_call('{"content": "It is sunny."}', auto.tool) == "It is sunny."
    assert parse_tool_call('{"name": "get_time", "arguments": {}}', auto.tool) == ("get_time", "{}")
    assert parse_tool_call('{"content": "It is sunny."}', ToolCallPlan("c", None)) is None


def test_parse_tool_call() -> None:
    assert parse_tool_call('{"city":"Oslo"}', ToolCallPlan("c", "get_weather")) == (
        "get_weather",
        '{"city":"Oslo"}',
    )
    picked = parse_tool_call('{"name": "get_time", "arguments": {}}', ToolCallPlan("c", None))
    assert picked == ("get_time", "{}")
    assert parse_tool_call('{"name": "get_ti', ToolCallPlan("c", None)) is None


def test_streamed_tool_call_deltas() -> None:
    shape = ResponseShape("chat", "chatcmpl-1", 1, "m")
    fmt = SseFormatter(shape, include_usage=False, tool=ToolCallPlan("call_1", "get_weather"))
    usage = Usage(prompt_tokens=3, completion_tokens=2)
    out = [
        *fmt.format(TokenChunk(request_id="r" * 16, seq=0, text='{"city":', num_tokens=1)),
        *fmt.format(FinalChunk(request_id="r" * 16, seq=1, text='"Oslo"}', num_tokens=1,
                               finish_reason=FinishReason.STOP, usage=usage, worker_id="w")),
    ]  # fmt: skip
    chunks = [json.loads(x) for x in out if x != "[DONE]"]
    calls = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks[:2]]
    assert calls[0]["id"] == "call_1"
    assert calls[0]["function"]["name"] == "get_weather"
    assert "id" not in calls[1]
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city":"Oslo"}'
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


SCHEMAS = st.sampled_from(
    [
        WEATHER["function"]["parameters"],  # type: ignore[index]
        {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}, "minItems": 2},
        {"anyOf": [{"type": "null"}, {"type": "number", "minimum": 5, "maximum": 6}]},
        {"$defs": {"p": {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"]}},
         "type": "object", "properties": {"p": {"$ref": "#/$defs/p"}}, "required": ["p"]},
        {"type": "string", "minLength": 12, "maxLength": 14},
        {"type": "integer", "multipleOf": 3, "minimum": 4},
        {"allOf": [{"type": "object", "properties": {"a": {"const": 1}}, "required": ["a"]}]},
    ]
)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(SCHEMAS, st.integers(min_value=0, max_value=10_000))
def test_sampled_json_validates(schema: dict[str, Any], seed: int) -> None:
    validate(sample(schema, seed=seed), schema)


def test_unsupported_schemas_are_reported() -> None:
    with pytest.raises(UnsupportedSchema):
        sample({"type": "object", "properties": {"a": {"$ref": "https://example.com/s"}}})

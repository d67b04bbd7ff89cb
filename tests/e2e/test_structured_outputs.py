"""Structured outputs and tool calls through the whole stack with the simulated engine, driven by the
official client (its tool-call stream accumulator included)."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from jsonschema import validate
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

from gpu_workers.simulated import answer_to, apply_stops, reply_text, structured_text
from infra.devstack import Endpoints
from openai_api.openai_types import ChatMessage
from openai_api.tokenizer import ByteTokenizer
from queue_schemas.messages import InferenceRequest, SamplingParams, StructuredOutput
from tests.e2e.conftest import openai_client

pytestmark = pytest.mark.timeout(90)

MODEL = "sluice-sim"
DEFAULT_MAX_TOKENS = 128  # the sim pool's default_max_tokens (queue_schemas/default_pools.toml)
ASK: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Plan a trip."}]
TRIP = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 2},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "stops": {"type": "array", "items": {"type": "string"}, "minItems": 2},
    },
    "required": ["city", "days", "stops"],
    "additionalProperties": False,
}
WEATHER_PARAMS: dict[str, object] = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
}
TOOLS: list[ChatCompletionToolParam] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}},
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    },
]


def first_call(completion: Any) -> tuple[str, str, str]:
    """(id, function name, arguments) of the completion's first tool call."""
    call = (completion.choices[0].message.tool_calls or [])[0]
    assert call.type == "function"
    return call.id, call.function.name, call.function.arguments


def trip_format() -> Any:
    return {"type": "json_schema", "json_schema": {"name": "trip", "schema": TRIP, "strict": True}}


def engine_answer(structured: StructuredOutput) -> str:
    """What the simulated engine answers to ASK under this constraint: the answer is a function of the
    prompt, max_tokens and the schema the worker received, so equality shows the worker got this one."""
    request = InferenceRequest(
        request_id="x" * 16, pool="sim", model=MODEL, team="t",
        prompt_token_ids=tuple(ByteTokenizer().encode_chat([ChatMessage.model_validate(m) for m in ASK])),
        sampling=SamplingParams(max_tokens=DEFAULT_MAX_TOKENS, structured=structured),
        created_at=0, deadline=1,
    )  # fmt: skip
    return structured_text(request, reply_text(request))


def test_json_schema_whole_and_streamed(endpoints: Endpoints) -> None:
    client = openai_client(endpoints)
    reply = client.chat.completions.create(model=MODEL, messages=ASK, response_format=trip_format())
    whole = reply.choices[0].message.content or ""
    validate(json.loads(whole), TRIP)
    assert whole == engine_answer(StructuredOutput(kind="json_schema", schema_text=json.dumps(TRIP)))
    stream = client.chat.completions.create(
        model=MODEL, messages=ASK, response_format=trip_format(), stream=True
    )
    chunks = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len([c for c in chunks if c]) > 1, "streamed in pieces"
    assert "".join(chunks) == whole, "the pieces reassemble into the same answer"


def test_json_object(endpoints: Endpoints) -> None:
    reply = openai_client(endpoints).chat.completions.create(
        model=MODEL, messages=ASK, response_format={"type": "json_object"}
    )
    text = reply.choices[0].message.content or ""
    assert isinstance(json.loads(text), dict)
    assert text == engine_answer(StructuredOutput(kind="json_object"))


def test_named_tool_call_whole_and_streamed(endpoints: Endpoints) -> None:
    client = openai_client(endpoints)
    choice: Any = {"type": "function", "function": {"name": "get_weather"}}
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice)
    assert reply.choices[0].finish_reason == "tool_calls"
    assert reply.choices[0].message.content is None
    _, name, arguments = first_call(reply)
    assert name == "get_weather"
    validate(json.loads(arguments), WEATHER_PARAMS)

    with client.chat.completions.stream(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice) as stream:
        final = stream.get_final_completion()
    call_id, streamed_name, streamed_arguments = first_call(final)
    assert final.choices[0].finish_reason == "tool_calls"
    assert (streamed_name, streamed_arguments) == (name, arguments)
    assert call_id.startswith("call_")


def test_required_tool_choice_lets_the_model_pick(endpoints: Endpoints) -> None:
    client = openai_client(endpoints)
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required")
    _, name, arguments = first_call(reply)
    assert name in {"get_weather", "get_time"}
    with client.chat.completions.stream(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required") as s:
        final = s.get_final_completion()
    assert first_call(final)[1:] == (name, arguments)


def test_auto_tool_choice_answers_with_a_call_or_text(endpoints: Endpoints) -> None:
    client = openai_client(endpoints)
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)  # auto by default
    # The simulated engine takes the schema's first branch: a call of the first tool.
    assert reply.choices[0].finish_reason == "tool_calls"
    _, name, arguments = first_call(reply)
    assert name == "get_weather"
    validate(json.loads(arguments), WEATHER_PARAMS)
    with client.chat.completions.stream(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="auto") as s:
        final = s.get_final_completion()
    assert first_call(final)[1:] == (name, arguments)


def test_tool_history_is_rendered_and_counted(endpoints: Endpoints) -> None:
    history: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_9",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_9", "content": "4 degrees, rain"},
    ]
    reply = openai_client(endpoints).chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice="none"
    )
    expected = ByteTokenizer().encode_chat(
        [ChatMessage.model_validate(m) for m in history], [dict(t) for t in TOOLS]
    )
    assert b"Oslo" in bytes(expected)  # the earlier call and the tool result are rendered
    assert b"get_time" in bytes(expected)  # and so are the tool definitions
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(expected)
    # The simulated engine answers as a function of the prompt ids it received: these ones.
    answer, _ = apply_stops(answer_to(expected), DEFAULT_MAX_TOKENS, ())
    assert reply.choices[0].message.content == answer


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}},
         "response_format.json_schema.schema"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch"}}},
         "tool_choice.function.name"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
          "tool_choice": "required"}, "tools.0.function.parameters"),
    ],
)  # fmt: skip
def test_bad_structured_input_is_a_400_naming_the_field(
    endpoints: Endpoints, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        openai_client(endpoints).chat.completions.create(model=MODEL, messages=ASK, **extra)
    assert err.value.status_code == 400
    body: Any = err.value.body
    assert body["param"] == param

"""The Responses API through the whole stack with the official client: streamed and whole answers,
background responses polled to their end, streams cut and resumed through the other ingress, cancel,
structured output and function calls, and the parts of the API that are not served."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import openai
import pytest
from jsonschema import validate

from infra.devstack import DevStack, Endpoints
from queue_schemas.errors import ErrorCode
from queue_schemas.messages import ErrorChunk, TokenChunk
from tests.e2e.conftest import day_used, openai_client, placed_on, running_on, team_key, terminal_log
from tests.e2e.test_streaming_contract import chat_prompt_ids, sim_reply
from tests.e2e.test_structured_outputs import TRIP, WEATHER_PARAMS
from tests.waiting import until

pytestmark = pytest.mark.timeout(120)

Stack = tuple[DevStack, Endpoints]


def client_at(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def expected_text(text: str, max_tokens: int) -> str:
    return sim_reply(chat_prompt_ids([{"role": "user", "content": text}]), max_tokens)


def read_until(stream: Any, chars: int) -> tuple[str, int, str]:
    """Read a response stream until `chars` characters of text have come: (response id, sequence
    number of the last event read, the text so far). The caller drops the connection then."""
    response_id, last, text = "", -1, ""
    for event in stream:
        assert event.sequence_number == last + 1, (event.type, event.sequence_number, last)
        last = event.sequence_number
        if event.type == "response.created":
            response_id = event.response.id
        if event.type == "response.output_text.delta":
            text += event.delta
            if len(text) >= chars:
                break
    return response_id, last, text


def resume(client: openai.OpenAI, response_id: str, after: int) -> tuple[str, list[Any]]:
    """The text of the events after `after`, and those events."""
    events = list(client.responses.retrieve(response_id, stream=True, starting_after=after))
    return "".join(e.delta for e in events if e.type == "response.output_text.delta"), events


def test_streamed_and_whole_answers_with_the_event_sequence(endpoints: Endpoints) -> None:
    client = openai_client(endpoints)
    question = "What does a queue do?"
    whole = client.responses.create(model="sluice-sim", input=question, max_output_tokens=400)
    assert whole.status == "completed"
    assert whole.id.startswith("resp_")
    assert whole.output_text == expected_text(question, 400)
    assert whole.usage is not None
    assert whole.usage.input_tokens == len(chat_prompt_ids([{"role": "user", "content": question}]))
    assert whole.usage.output_tokens == len(whole.output_text)  # the byte tokenizer: a token a byte

    events: list[Any] = list(
        client.responses.create(model="sluice-sim", input=question, max_output_tokens=400, stream=True)
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added",
    ]  # fmt: skip
    assert kinds[-4:] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1, "streamed in pieces"
    assert "".join(deltas) == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    # The whole answer's record is kept: it can be read back by its id.
    assert client.responses.retrieve(whole.id).output_text == whole.output_text


def test_instructions_and_message_input_are_the_chat_prompt(endpoints: Endpoints) -> None:
    client = openai_client(endpoints)
    reply = client.responses.create(
        model="sluice-sim", instructions="Be brief.", max_output_tokens=400,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
    )  # fmt: skip
    prompt = chat_prompt_ids([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert reply.usage is not None
    assert reply.usage.input_tokens == len(prompt)
    assert reply.output_text == sim_reply(prompt, 400)
    assert reply.instructions == "Be brief."


def test_a_background_response_is_polled_to_completed(dev_stack: Stack) -> None:
    stack, endpoints = dev_stack
    key = team_key(endpoints, "resp-poll")
    first, second = (client_at(url, key) for url in stack.ingress_urls)
    question = "Run this in the background."
    created = first.responses.create(
        model="sluice-slow", input=question, background=True, max_output_tokens=40
    )
    assert created.status == "queued"
    assert created.background is True
    seen = set()

    def ended() -> Any:
        got = second.responses.retrieve(created.id)  # any ingress serves it
        seen.add(got.status)
        return got if got.status not in ("queued", "in_progress") else None

    done = until(ended, 60, "the background response ended")
    assert done.status == "incomplete"  # it ran to its 40 tokens
    assert done.incomplete_details is not None
    assert done.incomplete_details.reason == "max_output_tokens"
    assert done.output_text == expected_text(question, 40)
    assert "in_progress" in seen
    assert done.usage is not None
    assert day_used(endpoints, "resp-poll") == done.usage.total_tokens


def test_a_dropped_stream_resumes_through_the_other_ingress(dev_stack: Stack) -> None:
    """The client drops the connection mid-way; the background response runs on, and its stream is read
    again through the other ingress from the event after the last one seen: no event is lost or
    repeated, and the text is the uninterrupted run's."""
    stack, endpoints = dev_stack
    key = team_key(endpoints, "resp-resume")
    first, second = (client_at(url, key) for url in stack.ingress_urls)
    question = "A long answer, please."
    stream = first.responses.create(
        model="sluice-slow", input=question, background=True, max_output_tokens=60, stream=True
    )
    response_id, last, before = read_until(stream, 8)
    stream.close()
    assert before
    assert last > 3
    after, events = resume(second, response_id, last)
    assert events[0].sequence_number == last + 1
    assert [e.sequence_number for e in events] == list(range(last + 1, last + 1 + len(events)))
    assert events[-1].type == "response.incomplete"
    assert before + after == expected_text(question, 60)
    assert before + after == events[-1].response.output_text
    # Read again from the start, once it has ended: the same events, made again from the log.
    again = list(first.responses.retrieve(response_id, stream=True))
    assert [e.type for e in again][last + 1 :] == [e.type for e in events]
    assert first.responses.retrieve(response_id).output_text == before + after


def test_a_foreground_stream_whose_client_leaves_is_cancelled(endpoints: Endpoints) -> None:
    key = team_key(endpoints, "resp-leave")
    client = openai_client(endpoints, key)
    stream = client.responses.create(
        model="sluice-slow", input="Stop me.", max_output_tokens=200, stream=True
    )
    response_id, _, text = read_until(stream, 3)
    stream.close()
    request_id = response_id.removeprefix("resp_")
    log = until(lambda: terminal_log(endpoints, request_id), 20, "the request's terminal chunk")
    assert isinstance(log[-1], ErrorChunk)
    assert log[-1].code == ErrorCode.CANCELLED
    generated = sum(e.num_tokens for e in log if isinstance(e, TokenChunk))
    assert len(text) <= generated < 200
    reply = client.responses.retrieve(response_id)
    assert reply.status == "cancelled"
    assert reply.usage is not None
    assert reply.usage.output_tokens == generated


def test_cancel_stops_the_engine_and_charges_what_was_generated(endpoints: Endpoints) -> None:
    key = team_key(endpoints, "resp-cancel")
    client = openai_client(endpoints, key)
    created = client.responses.create(
        model="sluice-slow", input="Cancel me.", background=True, max_output_tokens=200
    )
    until(lambda: len(client.responses.retrieve(created.id).output_text) >= 5, 30, "some output")
    started = time.monotonic()
    cancelled = client.responses.cancel(created.id)
    took = time.monotonic() - started
    assert cancelled.status == "cancelled"
    # The cancel waits (15 s here) for the worker's report of what it used: the report is in, so the
    # engine had stopped by then.
    assert cancelled.usage is not None, f"no report from the worker after {took:.2f} s"
    print(f"cancel: the worker stopped and reported in {took:.2f} s")
    request_id = created.id.removeprefix("resp_")
    log = terminal_log(endpoints, request_id)
    assert isinstance(log[-1], ErrorChunk)
    assert log[-1].code == ErrorCode.CANCELLED
    generated = sum(e.num_tokens for e in log if isinstance(e, TokenChunk))
    assert cancelled.usage.output_tokens == generated < 200
    assert day_used(endpoints, "resp-cancel") == cancelled.usage.total_tokens
    worker = placed_on(endpoints, request_id)
    until(lambda: running_on(endpoints, "slow", worker) == 0, 10, "the engine reported idle")
    # Cancelling again, or after the end, returns it as it is.
    assert client.responses.cancel(created.id).status == "cancelled"


def test_a_response_cancelled_as_soon_as_it_is_queued_ends(dev_stack: Stack) -> None:
    """Cancelled while it waits in the pool's topic (its dispatcher stopped meanwhile, so no worker can
    have started it): it ends at once with no output and is charged nothing."""
    stack, endpoints = dev_stack
    key = team_key(endpoints, "resp-queued")
    client = openai_client(endpoints, key)
    stack.halt("dispatcher-slow", kill=False)
    try:
        created = client.responses.create(
            model="sluice-slow", input="Cancel me early.", background=True, max_output_tokens=100
        )
        cancelled = client.responses.cancel(created.id)
    finally:
        stack.resume("dispatcher-slow")
    assert cancelled.status == "cancelled"
    events = list(client.responses.retrieve(created.id, stream=True))
    assert events[0].type == "response.created"
    assert events[-1].type == "response.failed"
    assert events[-1].response.status == "cancelled"
    assert events[-1].response.output == []
    usage = events[-1].response.usage
    assert usage is not None
    assert usage.output_tokens == 0
    # The dispatcher, back, reads the cancelled request and drops it: the next request on the pool is
    # answered, and the team is charged for that one alone.
    answer = client.responses.create(model="sluice-slow", input="After the cancel.", max_output_tokens=4)
    assert answer.status == "incomplete"  # answered, up to its 4 tokens
    assert answer.usage is not None
    spent = answer.usage.total_tokens
    until(lambda: day_used(endpoints, "resp-queued") == spent, 10, "only the answered request is charged")
    assert client.responses.retrieve(created.id).status == "cancelled"


def test_structured_output_and_function_calls(endpoints: Endpoints) -> None:
    client = openai_client(endpoints)
    fmt: Any = {"format": {"type": "json_schema", "name": "trip", "schema": TRIP, "strict": True}}
    trip = client.responses.create(model="sluice-sim", input="Plan a trip.", text=fmt)
    validate(json.loads(trip.output_text), TRIP)
    assert trip.text is not None
    assert trip.text.format is not None
    assert trip.text.format.type == "json_schema"

    tools: Any = [{"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMS, "strict": True}]
    choice: Any = {"type": "function", "name": "get_weather"}
    call = client.responses.create(model="sluice-sim", input="Weather?", tools=tools, tool_choice=choice)
    item: Any = call.output[0]
    assert item.type == "function_call"
    assert item.name == "get_weather"
    validate(json.loads(item.arguments), WEATHER_PARAMS)
    events: list[Any] = list(
        client.responses.create(
            model="sluice-sim", input="Weather?", tools=tools, tool_choice=choice, stream=True
        )
    )
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == item.arguments
    done = events[-1].response.output[0]
    assert done.type == "function_call"
    assert done.arguments == item.arguments

    # The call's output sent back as input items: rendered into the prompt like a chat tool turn.
    def tool_turn(output: str) -> Any:
        return client.responses.create(
            model="sluice-sim", tools=tools, tool_choice="none",
            input=[
                {"role": "user", "content": "Weather?"},
                {
                    "type": "function_call", "call_id": "call_1", "name": "get_weather",
                    "arguments": item.arguments,
                },
                {"type": "function_call_output", "call_id": "call_1", "output": output},
            ],
        )  # fmt: skip

    follow = tool_turn("sunny")
    assert follow.status in ("completed", "incomplete")
    # The tool's output is in the prompt: the same turn gives the same answer, another output another.
    assert tool_turn("sunny").output_text == follow.output_text
    assert tool_turn("rainy").output_text != follow.output_text, "the tool's output is in the prompt"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"conversation": "conv_0123"}, "conversation"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content.0.type",
        ),
        ({"background": True, "store": False}, "store"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"surprise": 1}, "surprise"),
    ],
)
def test_what_is_not_served_is_a_400_naming_it(
    endpoints: Endpoints, extra: dict[str, Any], param: str
) -> None:
    body = {"model": "sluice-sim", "input": "hello", **extra}
    response = httpx.post(
        endpoints.url + "/v1/responses",
        json=body,
        headers={"Authorization": f"Bearer {endpoints.api_key}"},
        timeout=10,
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


def test_unknown_and_unstored_responses_are_404(endpoints: Endpoints) -> None:
    client = openai_client(endpoints)
    unstored = client.responses.create(
        model="sluice-sim", input="forget me", store=False, max_output_tokens=5
    )
    assert unstored.output_text
    assert unstored.to_dict()["store"] is False
    for response_id in (unstored.id, "resp_" + "0" * 32, "not-an-id"):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(response_id)
    kept = client.responses.create(model="sluice-sim", input="delete me", max_output_tokens=5)
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)


def test_a_conversation_chained_by_previous_response_id_is_the_conversation_sent_whole(
    endpoints: Endpoints,
) -> None:
    client = openai_client(endpoints)
    turns = [
        "Queues decouple the services that write requests from the ones that serve them. What else do "
        "they give a serving system?",
        "And what do partitions add?",
        "Which of these matters most?",
    ]
    previous: str | None = None
    whole: list[Any] = []
    responses = []
    for n, text in enumerate(turns):
        chained = client.responses.create(
            model="sluice-sim", input=text, instructions="Be brief.", max_output_tokens=400,
            previous_response_id=previous,
        )  # fmt: skip
        whole.append({"role": "user", "content": text})
        sent_whole = client.responses.create(
            model="sluice-sim", input=whole, instructions="Be brief.", max_output_tokens=400, store=False
        )
        assert chained.status == "completed"
        assert chained.output_text == sent_whole.output_text, f"turn {n + 1}"
        assert chained.previous_response_id == previous
        assert chained.completed_at is not None
        assert chained.completed_at >= chained.created_at
        assert chained.usage is not None
        assert sent_whole.usage is not None
        assert chained.usage.input_tokens == sent_whole.usage.input_tokens
        if n:
            assert chained.usage.input_tokens_details.cached_tokens > 0, f"turn {n + 1} reuses the prefix"
        whole.append({"role": "assistant", "content": chained.output_text})
        responses.append(chained)
        previous = chained.id
    assert client.responses.retrieve(responses[1].id).previous_response_id == responses[0].id

    # The third turn's input items: the whole conversation before its answer, a page at a time.
    items = list(client.responses.input_items.list(responses[2].id, limit=2, order="asc"))
    assert [(i.type, getattr(i, "role", None)) for i in items] == [
        ("message", "user"), ("message", "assistant"), ("message", "user"), ("message", "assistant"),
        ("message", "user"),
    ]  # fmt: skip
    texts = [part.text for item in items for part in getattr(item, "content", [])]
    assert texts == [whole[0]["content"], whole[1]["content"], whole[2]["content"], whole[3]["content"],
                     whole[4]["content"]]  # fmt: skip
    newest_first = client.responses.input_items.list(responses[2].id, limit=2)
    assert [i.id for i in newest_first.data] == [items[4].id, items[3].id]
    assert newest_first.has_more

    # Another team sees none of it.
    other = openai_client(endpoints, team_key(endpoints, "chain-outsider"))
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(responses[2].id)
    with pytest.raises(openai.NotFoundError):
        other.responses.input_items.list(responses[2].id)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model="sluice-sim", input="and?", previous_response_id=responses[2].id)


def test_a_response_still_running_cannot_be_continued(endpoints: Endpoints) -> None:
    client = openai_client(endpoints)
    running = client.responses.create(
        model="sluice-sim", input="a long background answer", background=True, max_output_tokens=400
    )
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="sluice-sim", input="and?", previous_response_id=running.id)
    assert "still" in str(err.value)
    until(lambda: client.responses.retrieve(running.id).status == "completed", 30, "the first to end")
    after = client.responses.create(
        model="sluice-sim", input="and?", previous_response_id=running.id, max_output_tokens=50
    )
    assert after.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="sluice-sim", input="x", previous_response_id="resp_" + "0" * 32)

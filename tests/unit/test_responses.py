"""The Responses API's pure parts: what is served, the mapping onto a chat request, and the events and
objects made from a request's chunks (resumption depends on their being the same every time)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ingress.responses.api import (
    NOT_SERVED,
    ResponsesRequest,
    as_chat,
    check_served,
    output_as_input,
    page_of,
    parse_items,
    parse_response_id,
    repeated_id,
    request_items,
    stored_items,
)
from ingress.responses.events import (
    ResponseEvents,
    ResponseRecord,
    replayed,
    shown_status,
    unseen,
)
from openai_api.errors import InvalidRequest
from openai_api.openai_types import JsonSchemaResponseFormat, NamedToolChoice
from openai_api.structured import ToolCallPlan
from plumbing.replay import LOG_AFTER_END_MS, log_ttl_ms
from queue_schemas.errors import ErrorCode
from queue_schemas.messages import ErrorChunk, FinalChunk, FinishReason, StreamEvent, TokenChunk, Usage

RID = "ab" * 16


def record(**fields: Any) -> ResponseRecord:
    base: dict[str, Any] = {
        "request_id": RID, "team": "t", "model": "m", "created_at": 100.0, "deadline": 700.0,
        "prompt_tokens": 7,
    }  # fmt: skip
    return ResponseRecord(**{**base, **fields})


def tokens(*texts: str, end: FinishReason = FinishReason.STOP) -> list[StreamEvent]:
    chunks: list[StreamEvent] = [
        TokenChunk(request_id=RID, seq=i, text=t, num_tokens=len(t)) for i, t in enumerate(texts[:-1])
    ]
    last = texts[-1]
    usage = Usage(prompt_tokens=7, completion_tokens=sum(len(t) for t in texts))
    chunks.append(
        FinalChunk(
            request_id=RID,
            seq=len(texts) - 1,
            text=last,
            num_tokens=len(last),
            finish_reason=end,
            usage=usage,
            worker_id="w",
        )
    )
    return chunks


def all_events(rec: ResponseRecord, chunks: list[StreamEvent]) -> list[dict[str, Any]]:
    events = ResponseEvents(rec)
    out = events.opening()
    for chunk in chunks:
        out += events.feed(chunk)
    return out


def test_a_text_answer_makes_openais_event_sequence() -> None:
    events = all_events(record(), tokens("Hel", "lo", "!"))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed",
    ]  # fmt: skip
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    done = events[-1]["response"]
    assert done["status"] == "completed"
    assert done["output"][0]["content"][0]["text"] == "Hello!"
    assert done["usage"]["input_tokens"] == 7
    assert done["usage"]["output_tokens"] == 6
    assert events[0]["response"]["status"] == "in_progress"


def test_the_events_after_any_point_are_the_same_when_made_again() -> None:
    """What resumption relies on: the events after N, made again from the same chunks, are exactly
    those a client missed."""
    chunks = tokens("a", "bc", "", "def", "g")
    first = all_events(record(background=True), chunks)
    for after in range(-1, len(first)):
        again = all_events(record(background=True), chunks)
        assert unseen(again, after) == first[after + 1 :]


def test_a_background_response_is_queued_until_its_first_output() -> None:
    events = ResponseEvents(record(background=True))
    opening = events.opening()
    assert [e["type"] for e in opening] == ["response.created"]
    assert opening[0]["response"]["status"] == "queued"
    assert events.body()["status"] == "queued"
    out = events.feed(tokens("x", "y")[0])
    assert out[0]["type"] == "response.in_progress"
    assert events.body()["status"] == "in_progress"
    assert events.body()["output"][0]["content"][0]["text"] == "x"  # the partial output so far


def test_cut_by_max_output_tokens_is_incomplete() -> None:
    events = all_events(record(), tokens("ab", "c", end=FinishReason.LENGTH))
    assert events[-1]["type"] == "response.incomplete"
    body = events[-1]["response"]
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete"


@pytest.mark.parametrize(
    ("code", "status"), [(ErrorCode.CANCELLED, "cancelled"), (ErrorCode.TIMEOUT, "failed")]
)
def test_an_error_chunk_ends_it_with_what_was_used(code: str, status: str) -> None:
    chunks: list[StreamEvent] = [
        TokenChunk(request_id=RID, seq=0, text="abc", num_tokens=3),
        ErrorChunk(request_id=RID, seq=1, code=code, message="stopped"),
    ]
    events = all_events(record(), chunks)
    assert events[-1]["type"] == "response.failed"
    body = events[-1]["response"]
    assert body["status"] == status
    assert body["usage"]["input_tokens"] == 7
    assert body["usage"]["output_tokens"] == 3
    assert (body["error"] is None) == (status == "cancelled")
    # Never started: nothing was used.
    never = all_events(record(), [ErrorChunk(request_id=RID, seq=0, code=code, message="stopped")])
    assert never[-1]["response"]["usage"]["total_tokens"] == 0


def test_a_named_function_streams_its_arguments() -> None:
    rec = record(tool=ToolCallPlan("call_1", "f"))
    events = all_events(rec, tokens('{"a"', ": 1}"))
    kinds = [e["type"] for e in events]
    assert kinds.count("response.function_call_arguments.delta") == 2
    item = events[-1]["response"]["output"][0]
    assert item == {
        "id": f"fc_{RID}", "type": "function_call", "status": "completed", "call_id": "call_1",
        "name": "f", "arguments": '{"a": 1}',
    }  # fmt: skip


def test_a_picked_function_or_a_plain_answer_is_known_at_the_end() -> None:
    rec = record(tool=ToolCallPlan("call_1", None, auto=True))
    call = json.dumps({"name": "g", "arguments": {"x": 2}})
    events = all_events(rec, tokens(call[:5], call[5:]))
    item = events[-1]["response"]["output"][0]
    assert item["type"] == "function_call"
    assert item["name"] == "g"
    assert json.loads(item["arguments"]) == {"x": 2}
    text = json.dumps({"content": "no call needed"})
    answer = all_events(rec, tokens(text[:3], text[3:]))[-1]["response"]["output"][0]
    assert answer["type"] == "message"
    assert answer["content"][0]["text"] == "no call needed"


def test_a_retrieve_shows_a_cancel_not_yet_reported_and_a_missed_deadline() -> None:
    events = replayed(record(background=True), tokens("a", "b")[:1])
    assert shown_status(events, cancelled=True, now=200.0) == "cancelled"
    assert shown_status(events, cancelled=False, now=200.0) is None
    assert shown_status(events, cancelled=False, now=701.0) == "failed"
    assert events.error is not None
    ended = replayed(record(background=True), tokens("a", "b"))
    assert shown_status(ended, cancelled=True, now=800.0) is None  # it finished first: completed


def test_input_maps_onto_a_chat_request() -> None:
    body = ResponsesRequest.model_validate({
        "model": "m", "instructions": "Be brief.", "max_output_tokens": 9,
        "input": [
            {"role": "user", "content": [
                {"type": "input_text", "text": "Hi"}, {"type": "input_text", "text": "!"},
            ]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
            {"type": "function_call_output", "call_id": "c2", "output": "two"},
        ],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "f"},
        "text": {"format": {"type": "json_schema", "name": "s", "schema": {"type": "object"}}},
    })  # fmt: skip
    chat = as_chat(body)
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool", "tool"]
    assert chat.messages[1].text() == "Hi!"
    assert [c.id for c in chat.messages[2].tool_calls or []] == ["c1", "c2"]
    assert chat.messages[3].tool_call_id == "c1"
    assert chat.requested_max_tokens() == 9
    assert isinstance(chat.tool_choice, NamedToolChoice)
    assert chat.tool_choice.function.name == "f"
    assert isinstance(chat.response_format, JsonSchemaResponseFormat)
    assert chat.response_format.json_schema.schema_ == {"type": "object"}
    assert [t.function.name for t in chat.tools or []] == ["f"]


@pytest.mark.parametrize("name", sorted(NOT_SERVED))
def test_each_part_not_served_is_a_400_naming_it(name: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        check_served({"model": "m", "input": "x", name: {"any": "value"}})
    assert err.value.param == name
    empties: list[Any] = [None, [], {}, 0]
    for empty in empties:  # the same as leaving it out
        check_served({"model": "m", "input": "x", name: empty})


def test_built_in_tools_and_non_text_input_are_refused_by_name() -> None:
    with pytest.raises(InvalidRequest) as err:
        check_served({"input": "x", "tools": [{"type": "function"}, {"type": "file_search"}]})
    assert err.value.param == "tools.1.type"
    with pytest.raises(InvalidRequest) as err:
        check_served({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]})
    assert err.value.param == "input.0.content.0.type"
    with pytest.raises(InvalidRequest) as err:
        check_served({"input": [{"type": "reasoning", "summary": []}]})
    assert err.value.param == "input.0.type"


def test_response_ids_are_ours_or_not_found() -> None:
    assert parse_response_id(f"resp_{RID}") == RID
    for bad in (RID, "resp_", f"resp_{RID}0", "resp_" + "G" * 32, f"chatcmpl-{RID}"):
        assert parse_response_id(bad) is None


def test_a_stored_responses_log_lives_as_long_as_its_record() -> None:
    # Running or ended, until keep_s past the deadline; without keep_s, minutes after the end.
    assert log_ttl_ms(deadline=700.0, now=100.0, terminal=False, keep_s=3600) == (600 + 3600) * 1000
    assert log_ttl_ms(deadline=700.0, now=650.0, terminal=True, keep_s=3600) == (50 + 3600) * 1000
    assert log_ttl_ms(deadline=700.0, now=650.0, terminal=True) == LOG_AFTER_END_MS


def test_a_chained_turn_is_the_previous_input_and_output_then_its_own() -> None:
    first = ResponsesRequest(model="m", input="What is a queue?", instructions="Be brief.")
    stored = stored_items(request_items(first))
    assert stored[0]["content"] == [{"type": "input_text", "text": "What is a queue?"}]
    assert stored[0]["id"].startswith("msg_")
    assert stored[0]["status"] == "completed"
    events = replayed(record(), tokens("A line ", "of work."))
    assert events.completed_at is None, "the final chunk said nothing of when it ended"
    answer = output_as_input(events.output)
    assert [item["role"] for item in answer] == ["assistant"]
    second = ResponsesRequest(model="m", input="And a topic?", instructions="Answer in French.")
    items = stored + answer + stored_items(request_items(second))
    chat = as_chat(second.model_copy(update={"input": parse_items(items)}))
    assert [(m.role, m.content) for m in chat.messages] == [
        ("system", "Answer in French."),  # this turn's instructions only: the first's are not carried
        ("user", "What is a queue?"),
        ("assistant", "A line of work."),
        ("user", "And a topic?"),
    ]


def test_a_function_call_of_the_previous_turn_is_input_for_the_next() -> None:
    output = [{"id": "fc_1", "type": "function_call", "status": "completed", "call_id": "c1", "name": "f",
               "arguments": "{}"}]  # fmt: skip
    reply = {"type": "function_call_output", "call_id": "c1", "output": "42"}
    items = output_as_input(output) + stored_items(parse_items([reply]))
    chat = as_chat(ResponsesRequest(model="m", input=parse_items(items)))
    assert chat.messages[0].tool_calls is not None
    assert chat.messages[0].tool_calls[0].id == "c1"
    assert (chat.messages[1].role, chat.messages[1].tool_call_id, chat.messages[1].content) == (
        "tool",
        "c1",
        "42",
    )


def test_input_items_are_paged_as_openai_lists_them() -> None:
    items = [{"id": f"msg_{i}"} for i in range(5)]
    first = page_of(items, 2, "desc", None)
    assert first is not None
    assert [d["id"] for d in first["data"]] == ["msg_4", "msg_3"]
    assert (first["first_id"], first["last_id"], first["has_more"]) == ("msg_4", "msg_3", True)
    rest = page_of(items, 10, "desc", first["last_id"])
    assert rest is not None
    assert [d["id"] for d in rest["data"]] == ["msg_2", "msg_1", "msg_0"]
    assert rest["has_more"] is False
    ascending = page_of(items, 5, "asc", None)
    assert ascending is not None
    assert [d["id"] for d in ascending["data"]] == [f"msg_{i}" for i in range(5)]
    assert ascending["has_more"] is False
    assert page_of(items, 2, "asc", "msg_9") is None
    assert page_of([], 2, "asc", None) == {
        "object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False,
    }  # fmt: skip


def test_a_completed_response_reports_when_it_ended() -> None:
    chunks = tokens("Done.")
    final = chunks[-1]
    assert isinstance(final, FinalChunk)
    events = replayed(
        record(echo={"previous_response_id": "resp_x"}), [final.model_copy(update={"ended_at": 123.9})]
    )
    body = events.body()
    assert body["completed_at"] == 123
    assert body["previous_response_id"] == "resp_x"
    cut = replayed(
        record(), [final.model_copy(update={"ended_at": 5.0, "finish_reason": FinishReason.LENGTH})]
    )
    assert cut.body()["completed_at"] is None, "only a completed response has completed_at"


def test_an_item_id_sent_twice_is_found() -> None:
    assert repeated_id([{"id": "a"}, {"id": "b"}, {}]) is None
    assert repeated_id([{"id": "a"}, {"id": "b"}, {"id": "a"}]) == "a"

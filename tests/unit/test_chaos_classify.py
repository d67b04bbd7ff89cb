"""The chaos suite's judge of one stream's ending, on hand-made event sequences."""

import json

from tests.chaos.load import classify


def chunk(content: str | None = None, finish: str | None = None) -> str:
    return json.dumps({"choices": [{"delta": {"content": content}, "finish_reason": finish}], "usage": None})


def usage(completion_tokens: int) -> str:
    return json.dumps({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": completion_tokens}})


ERROR = json.dumps({"error": {"code": "worker_lost", "message": "gone"}})


def test_a_complete_answer_is_ok() -> None:
    assert classify([chunk(""), chunk("ab"), chunk("c"), chunk("", "stop"), usage(3), "[DONE]"]) == ("ok", "")


def test_an_error_event_is_one_terminal_event_with_its_code() -> None:
    assert classify([chunk(""), chunk("ab"), ERROR]) == ("error", "worker_lost")


def test_a_stream_without_a_terminal_event_was_cut() -> None:
    assert classify([chunk(""), chunk("ab")])[0] == "cut"


def test_duplicates_extra_events_and_missing_parts_are_bad() -> None:
    duplicated = [chunk(""), chunk("ab"), chunk("ab"), chunk("", "stop"), usage(2), "[DONE]"]
    assert classify(duplicated)[0] == "bad"
    two_finishes = [chunk("ab", "stop"), chunk("", "stop"), usage(2), "[DONE]"]
    assert classify(two_finishes)[0] == "bad"
    finish_then_error = [chunk("ab", "stop"), ERROR]
    assert classify(finish_then_error)[0] == "bad"
    after_done = [chunk("ab", "stop"), usage(2), "[DONE]", chunk("c")]
    assert classify(after_done)[0] == "bad"
    after_error = [ERROR, chunk("c")]
    assert classify(after_error)[0] == "bad"
    no_usage = [chunk("ab", "stop"), "[DONE]"]
    assert classify(no_usage)[0] == "bad"

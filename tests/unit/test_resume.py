"""Reading a completion stream again (ingress.resume): ids, where a client left off, who may read it."""

from __future__ import annotations

from typing import Any

from sse_starlette import ServerSentEvent

from ingress.resume import (
    RETRY_MS,
    StreamRecord,
    cancel_after_grace,
    last_event_id,
    new_token,
    numbered,
    request_id_of,
    sse_frame,
    token_matches,
)

RID = "0123456789abcdef" * 2


def record(kind: str = "chat") -> StreamRecord:
    return StreamRecord.model_validate({
        "request_id": RID, "team": "t", "pool": "sim", "kind": kind, "model": "m", "created": 1,
        "deadline": 2.0, "token": "k" * 43,
    })  # fmt: skip


def test_a_completion_id_names_its_request() -> None:
    assert request_id_of(f"chatcmpl-{RID}", "chat") == RID
    assert request_id_of(RID, "chat") == RID
    assert request_id_of(f"cmpl-{RID}", "text") == RID
    for bad in ("chatcmpl-xyz", f"chatcmpl-{RID}0", f"chatcmpl-{RID.upper()}", "", "../" + RID):
        assert request_id_of(bad, "chat") is None, bad


def test_where_a_client_left_off() -> None:
    assert last_event_id(None, None) == -1, "from the start"
    assert last_event_id("", 4) == 4
    assert last_event_id("7", None) == 7
    assert last_event_id(" 7 ", 2) == 7, "EventSource's own header wins over ?after="
    for bad in ("-1", "seven", "1.5", "9" * 12, "\xb2", "\u0663"):
        assert last_event_id(bad, None) is None, bad


def test_events_are_numbered_and_the_seen_ones_skipped() -> None:
    def encoded(*events: dict[str, Any]) -> bytes:
        return b"".join(ServerSentEvent(**e).encode() for e in events)

    assert numbered(["a", "b", "c"], 4, -1) == encoded(
        {"id": "4", "data": "a"}, {"id": "5", "data": "b"}, {"id": "6", "data": "c"}
    )
    assert numbered(["a", "b", "c"], 4, 5) == encoded({"id": "6", "data": "c"})
    assert numbered(["a"], 0, -1) == encoded({"id": "0", "data": "a", "retry": RETRY_MS}), (
        "the first sets retry"
    )
    assert numbered(["a"], 0, 9) == b""


def test_frames_are_what_sse_starlette_writes() -> None:
    for payload in ('{"x":"d\u00e9j\u00e0 vu"}', "[DONE]", "", "tab\there \u2028 \x85"):
        assert sse_frame(payload) == ServerSentEvent(payload).encode()
        assert sse_frame(payload, "12") == ServerSentEvent(payload, id="12").encode()
        assert sse_frame(payload, "0", 3000) == ServerSentEvent(payload, id="0", retry=3000).encode()


def test_the_stream_path_carries_its_token() -> None:
    chat, text = record(), record("text")
    assert chat.path() == f"/v1/chat/completions/chatcmpl-{RID}/stream?token={'k' * 43}"
    assert text.path().startswith(f"/v1/completions/cmpl-{RID}/stream?token=")
    assert token_matches(chat, "k" * 43)
    assert not token_matches(chat, "k" * 42 + "j")
    assert len(new_token()) >= 32
    assert new_token() != new_token()


def test_a_left_request_is_cancelled_only_with_no_reader_connected_or_come_back() -> None:
    assert cancel_after_grace(live=0, epoch=0, epoch_at_leave=0), "the only reader left for good"
    assert not cancel_after_grace(live=1, epoch=1, epoch_at_leave=0), "a reader came back and reads"
    assert not cancel_after_grace(live=1, epoch=1, epoch_at_leave=1), "another reader is still connected"
    assert not cancel_after_grace(live=0, epoch=2, epoch_at_leave=1), (
        "one came back since (its own timer runs)"
    )
    assert cancel_after_grace(live=-1, epoch=0, epoch_at_leave=0), "a stream with no record counts below zero"

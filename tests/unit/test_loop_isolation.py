"""The usage relay's decisions about one outbox entry: what becomes a record, what is done with."""

from __future__ import annotations

import json

import pytest
from aiokafka.errors import (
    KafkaConnectionError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    RecordTooLargeError,
)

from ingress.usage_relay import entry_settled, outbox_record, team_names

EVENT = {
    "request_id": "req-1", "team": "acme", "pool": "sim", "model": "m", "kind": "interactive",
    "status": "completed", "prompt_tokens": 3, "completion_tokens": 2, "total_s": 1.0, "created_at": 1.0,
    "ended_at": 2.0,
}  # fmt: skip


def test_an_outbox_entry_becomes_its_event_with_what_was_charged_keyed_by_request() -> None:
    value, key = outbox_record({b"e": json.dumps(EVENT).encode(), b"charged": b"5.0"})
    assert key == b"req-1"
    assert json.loads(value)["charged_tokens"] == 5


@pytest.mark.parametrize(
    "fields",
    [
        {b"e": json.dumps(EVENT).encode(), b"charged": b"inf"},  # OverflowError, not a ValueError
        {b"e": json.dumps(EVENT).encode(), b"charged": b"nan"},
        {b"e": json.dumps(EVENT).encode()},
        {b"e": b"{not json", b"charged": b"1"},
        {b"e": json.dumps({**EVENT, "prompt_tokens": -1}).encode(), b"charged": b"1"},
    ],
)
def test_an_entry_that_cannot_be_a_record_raises(fields: dict[bytes, bytes]) -> None:
    with pytest.raises((ValueError, KeyError, ArithmeticError)):
        outbox_record(fields)


def test_an_entry_is_done_with_once_sent_or_refused_for_good_and_stays_pending_otherwise() -> None:
    assert entry_settled(object())  # the broker's record metadata
    assert entry_settled(MessageSizeTooLargeError())
    assert entry_settled(RecordTooLargeError())
    assert not entry_settled(KafkaConnectionError())
    assert not entry_settled(KafkaTimeoutError())
    assert not entry_settled(RuntimeError("anything else"))


def test_team_names_skip_a_member_that_is_not_utf8() -> None:
    assert team_names([b"acme", "beta", b"\xff\xfe"]) == {"acme", "beta"}

"""Fuzzing every wire decoder: whatever bytes arrive, a decoder returns a valid message or raises
SchemaError with a reason, never anything else; a message truncated anywhere is refused; a valid one
survives the round trip."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from queue_schemas.batch import BatchAnswer, BatchSubmission, load_record, read_envelope
from queue_schemas.codec import decode, decode_channel_message, decode_stream_event, encode
from queue_schemas.errors import SchemaError
from queue_schemas.messages import (
    SCHEMA_VERSION,
    CancelNotice,
    DeadLetter,
    ErrorChunk,
    FinalChunk,
    FinishReason,
    Heartbeat,
    InferenceRequest,
    KvEvent,
    KvSnapshot,
    Message,
    PoolState,
    SamplingParams,
    TokenChunk,
    Usage,
)
from queue_schemas.names import Names

MODELS: list[type[Message]] = [
    InferenceRequest, TokenChunk, FinalChunk, ErrorChunk, Heartbeat, CancelNotice, DeadLetter, PoolState,
    KvEvent, KvSnapshot, BatchSubmission, BatchAnswer,
]  # fmt: skip

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)

REQUEST = InferenceRequest(
    request_id="fuzz-request-0001", pool="sim", model="sluice-sim", team="dev", prompt_token_ids=(1, 2, 3),
    block_hashes=("a1", "b2"), sampling=SamplingParams(max_tokens=8, stop=("\n",)), created_at=1.0,
    deadline=2.0,
)  # fmt: skip
SAMPLES: list[Message] = [
    REQUEST,
    TokenChunk(request_id="fuzz-request-0001", seq=0, text="hé", num_tokens=1),
    FinalChunk(
        request_id="fuzz-request-0001",
        seq=1,
        text="!",
        num_tokens=1,
        finish_reason=FinishReason.STOP,
        usage=Usage(prompt_tokens=3, completion_tokens=2),
        worker_id="w1",
    ),
    ErrorChunk(request_id="fuzz-request-0001", seq=2, code="timeout", message="late"),
    CancelNotice(request_id="fuzz-request-0001", reason="client disconnected", sent_at=1.0),
]


def decoders() -> list[Any]:
    return [lambda data, m=m: decode(m, data) for m in MODELS] + [decode_stream_event, decode_channel_message]


def refusals(data: bytes) -> list[str]:
    """Each decoder's reason for refusing `data` ('' where it decoded); any other exception escapes."""
    reasons = []
    for decoder in decoders():
        try:
            decoder(data)
            reasons.append("")
        except SchemaError as exc:
            reasons.append(str(exc) or "SchemaError without a reason")
    return reasons


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_any_bytes_decode_or_raise_schema_error(data: bytes) -> None:
    assert "SchemaError without a reason" not in refusals(data)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.text(max_size=12), JSON, max_size=8), st.sampled_from([SCHEMA_VERSION, 0, 99, "1"]))
def test_any_json_object_decodes_or_raises_schema_error(obj: dict[str, Any], version: object) -> None:
    data = json.dumps({**obj, "v": version}).encode()
    assert "SchemaError without a reason" not in refusals(data)
    if version != SCHEMA_VERSION:
        with pytest.raises(SchemaError, match="unsupported schema version"):
            decode(InferenceRequest, data)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(SAMPLES), st.data())
def test_a_truncated_message_is_refused_and_a_whole_one_round_trips(
    message: Message, data: st.DataObject
) -> None:
    raw = encode(message)
    assert decode(type(message), raw) == message
    cut = data.draw(st.integers(min_value=0, max_value=len(raw) - 1))
    with pytest.raises(SchemaError):
        decode(type(message), raw[:cut])


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(SAMPLES), st.data())
def test_a_corrupted_byte_is_refused_or_still_a_valid_message(message: Message, data: st.DataObject) -> None:
    raw = bytearray(encode(message))
    at = data.draw(st.integers(min_value=0, max_value=len(raw) - 1))
    raw[at] = data.draw(st.integers(min_value=0, max_value=255))
    try:
        decoded = decode(type(message), bytes(raw))
    except SchemaError:
        return
    assert isinstance(decoded, type(message))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200) | JSON.map(lambda v: json.dumps(v).encode()))
def test_a_batch_record_parses_or_says_why(raw: bytes) -> None:
    """What a batch submitter can write to a batch topic: an envelope with a reply topic, or a reason."""
    record = load_record(raw)
    if isinstance(record, str):
        assert record
        return
    envelope = read_envelope(record, Names("sluice"), ("sim",))
    assert isinstance(envelope, str) or envelope.reply_topic


def test_an_oversized_message_is_refused_before_parsing() -> None:
    huge = b'{"v": 1, "text": "' + b"x" * (5 * 1024 * 1024) + b'"}'
    with pytest.raises(SchemaError, match="exceeds"):
        decode(TokenChunk, huge)

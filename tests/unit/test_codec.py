import json
from collections.abc import Callable

import pytest

from queue_schemas.codec import decode, decode_channel_message, decode_stream_event, encode
from queue_schemas.errors import SchemaError
from queue_schemas.messages import (
    ErrorChunk,
    FinalChunk,
    FinishReason,
    InferenceRequest,
    SamplingParams,
    TokenChunk,
    Usage,
)


def make_request(**overrides: object) -> InferenceRequest:
    fields: dict[str, object] = {
        "request_id": "r" * 16,
        "pool": "sim",
        "model": "sluice-sim",
        "team": "dev",
        "prompt_token_ids": (1, 2, 3),
        "sampling": SamplingParams(max_tokens=8),
        "created_at": 1.0,
        "deadline": 2.0,
    }
    fields.update(overrides)
    return InferenceRequest.model_validate(fields)


def test_request_round_trips() -> None:
    req = make_request(block_hashes=("ab",))
    assert decode(InferenceRequest, encode(req)) == req


def test_stream_events_decode_to_their_kind() -> None:
    usage = Usage(prompt_tokens=3, completion_tokens=2)
    events = [
        TokenChunk(request_id="r" * 16, seq=0, text="hi", num_tokens=1),
        FinalChunk(request_id="r" * 16, seq=1, finish_reason=FinishReason.STOP, usage=usage, worker_id="w"),
        ErrorChunk(request_id="r" * 16, seq=0, code="timeout", message="late"),
    ]
    for event in events:
        assert decode_stream_event(encode(event)) == event


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\xff\xfe", "not valid JSON"),
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "expected a JSON object"),
        (b'{"request_id": "x"}', "unsupported schema version None"),
        (b'{"v": 2}', "unsupported schema version 2"),
    ],
)
def test_garbage_is_refused_with_a_reason(payload: bytes, reason: str) -> None:
    with pytest.raises(SchemaError, match=reason):
        decode(InferenceRequest, payload)


def test_invalid_fields_are_named() -> None:
    obj = json.loads(encode(make_request()))
    obj["prompt_token_ids"] = []
    obj["surprise"] = 1
    with pytest.raises(SchemaError, match=r"prompt_token_ids.*surprise|surprise.*prompt_token_ids"):
        decode(InferenceRequest, json.dumps(obj))


def test_oversized_message_is_refused() -> None:
    with pytest.raises(SchemaError, match="exceeds"):
        decode(InferenceRequest, b" " * (5 * 1024 * 1024))


def test_request_id_must_be_safe_for_key_names() -> None:
    with pytest.raises(ValueError, match="request_id"):
        make_request(request_id="has spaces and : colons")


CHUNK = TokenChunk(request_id="r" * 16, seq=0, text="hi", num_tokens=1)


@pytest.mark.parametrize("decoder", [decode_stream_event, decode_channel_message])
def test_a_stream_message_is_parsed_once_by_pydantic(
    decoder: Callable[[bytes], object], monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(data: object) -> object:
        raise AssertionError("read a second time")

    monkeypatch.setattr(json, "loads", refuse)
    assert decoder(encode(CHUNK)) == CHUNK


@pytest.mark.parametrize("decoder", [decode_stream_event, decode_channel_message])
@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\xff\xfe", "not valid JSON"),
        (b"{not json", "not valid JSON"),
        (b"[" * 100_000, "not valid JSON: nested too deeply"),
        (b"[1, 2]", "expected a JSON object, got list"),
        (b'{"request_id": "x"}', "unsupported schema version None"),
        (b'{"v": 2, "kind": "tokens"}', "unsupported schema version 2"),
        (b'{"v": 1, "kind": "nope"}', r"invalid stream (event|message): <root>: Input tag 'nope'"),
        (b" " * (5 * 1024 * 1024), "exceeds"),
        (encode(CHUNK).replace(b'"seq":0', b'"seq":' + b"9" * 5000), "not valid JSON"),
    ],
)
def test_a_stream_message_is_refused_with_the_reason_decode_gives(
    decoder: Callable[[bytes], object], payload: bytes, reason: str
) -> None:
    with pytest.raises(SchemaError, match=reason):
        decoder(payload)


@pytest.mark.parametrize("decoder", [decode_stream_event, decode_channel_message])
def test_a_stream_message_json_loads_reads_is_still_read(decoder: Callable[[bytes], object]) -> None:
    text = encode(CHUNK).decode()
    assert decoder(text.encode("utf-16")) == CHUNK, "UTF-16, which only the standard library reads"
    assert decoder(text.replace('"text":"hi"', '"text":"\\ud800"').encode()) == CHUNK.model_copy(
        update={"text": "\ud800"}
    ), "a lone surrogate"
    assert decoder(text.replace('"seq":0', '"seq":0,"seq":3').encode()) == CHUNK.model_copy(update={"seq": 3})

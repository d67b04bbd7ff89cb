"""Wire encoding: compact JSON (UTF-8) of the pydantic models, with a version check that names the problem."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError

from queue_schemas.errors import SchemaError
from queue_schemas.messages import SCHEMA_VERSION, ChannelMessage, StreamEvent

M = TypeVar("M", bound=BaseModel)

MAX_MESSAGE_BYTES = 4 * 1024 * 1024
_stream_event_adapter: TypeAdapter[StreamEvent] = TypeAdapter(StreamEvent)
_channel_adapter: TypeAdapter[ChannelMessage] = TypeAdapter(ChannelMessage)


def encode(message: BaseModel) -> bytes:
    return message.model_dump_json().encode()


def _load_object(data: bytes | str) -> dict[str, Any]:
    if len(data) > MAX_MESSAGE_BYTES:
        raise SchemaError(f"message of {len(data)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    try:
        obj = json.loads(data)
    except ValueError as exc:  # bad UTF-8, bad JSON, or an integer too long to convert
        raise SchemaError(f"not valid JSON: {exc}") from None
    except RecursionError:
        raise SchemaError("not valid JSON: nested too deeply") from None
    if not isinstance(obj, dict):
        raise SchemaError(f"expected a JSON object, got {type(obj).__name__}")
    version = obj.get("v")
    if version != SCHEMA_VERSION:
        raise SchemaError(f"unsupported schema version {version!r} (this build speaks v{SCHEMA_VERSION})")
    return obj


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:5]:
        where = ".".join(str(p) for p in err["loc"]) or "<root>"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


def decode(model: type[M], data: bytes | str) -> M:
    """Decode one message of type `model`; raise SchemaError with a readable reason otherwise."""
    obj = _load_object(data)
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        raise SchemaError(f"invalid {model.__name__}: {_describe(exc)}") from None


def decode_stream_event(data: bytes | str) -> StreamEvent:
    """Decode a chunk published on a request's stream channel (tokens, final or error)."""
    obj = _load_object(data)
    try:
        return _stream_event_adapter.validate_python(obj)
    except ValidationError as exc:
        raise SchemaError(f"invalid stream event: {_describe(exc)}") from None


def decode_channel_message(data: bytes | str) -> ChannelMessage:
    """Decode a message on a request's stream channel: a chunk, or the mark of a move."""
    obj = _load_object(data)
    try:
        return _channel_adapter.validate_python(obj)
    except ValidationError as exc:
        raise SchemaError(f"invalid stream message: {_describe(exc)}") from None

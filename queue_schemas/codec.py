"""Wire encoding: compact JSON (UTF-8) of the pydantic models, with a version check that names the problem."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError

from queue_schemas.errors import SchemaError
from queue_schemas.messages import SCHEMA_VERSION, ChannelMessage, StreamEvent

M = TypeVar("M", bound=BaseModel)
T = TypeVar("T")

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


def _decode_union(adapter: TypeAdapter[T], data: bytes | str, what: str) -> T:
    """A message of a stream, parsed and validated in one pass by pydantic. What that refuses is read again
    as `decode` reads a message, so it is refused (or, where only the JSON parsers differ, accepted) for
    the same reason as by `decode`."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise SchemaError(f"message of {len(data)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    try:
        return adapter.validate_json(data)
    except ValidationError:
        pass
    obj = _load_object(data)
    try:
        return adapter.validate_python(obj)
    except ValidationError as exc:
        raise SchemaError(f"invalid {what}: {_describe(exc)}") from None


def decode_stream_event(data: bytes | str) -> StreamEvent:
    """Decode a chunk published on a request's stream channel (tokens, final or error)."""
    return _decode_union(_stream_event_adapter, data, "stream event")


def decode_channel_message(data: bytes | str) -> ChannelMessage:
    """Decode a message on a request's stream channel: a chunk, or the mark of a move."""
    return _decode_union(_channel_adapter, data, "stream message")

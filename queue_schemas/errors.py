"""Error codes carried on the bus. Each service translates them to HTTP/SSE only at its edge."""

from enum import StrEnum


class ErrorCode(StrEnum):
    TIMEOUT = "timeout"  # the request's deadline passed before it finished
    CANCELLED = "cancelled"  # the client or an operator cancelled it
    ENGINE_ERROR = "engine_error"  # the engine failed while generating
    WORKER_LOST = "worker_lost"  # the worker serving it went away mid-stream
    BAD_REQUEST = "bad_request"  # the message was valid on the wire but cannot be served
    OVERLOADED = "overloaded"  # a sheddable request no worker could serve within its TTFT SLO


class SchemaError(ValueError):
    """Raised when bytes from the bus are not a valid message of the expected type and version."""

"""The errors ingress answers with, in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from typing import Any

from queue_schemas.errors import ErrorCode


class ApiError(Exception):
    status: int = 500
    type: str = "api_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}
        if code is not None:
            self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class InvalidRequest(ApiError):
    status = 400
    type = "invalid_request_error"


class PayloadTooLarge(InvalidRequest):
    status = 413
    code = "request_too_large"


class LengthRequired(InvalidRequest):
    status = 411
    code = "length_required"


class AuthenticationFailed(ApiError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class PermissionDenied(ApiError):
    status = 403
    type = "invalid_request_error"
    code = "permission_denied"


class NotFound(InvalidRequest):
    status = 404


class MethodNotAllowed(InvalidRequest):
    status = 405
    code = "method_not_allowed"


class RateLimited(ApiError):
    """429 that the client should retry after Retry-After."""

    status = 429
    type = "requests"
    code = "rate_limit_exceeded"


class InsufficientQuota(ApiError):
    """429 that retrying will not fix (budget spent, or the request alone exceeds a limit)."""

    status = 429
    type = "insufficient_quota"
    code = "insufficient_quota"


class Overloaded(ApiError):
    """429 for a sheddable (flex) request refused because no worker could serve it within its SLO now;
    a later retry may be served."""

    status = 429
    type = "requests"
    code = "resource_unavailable"


class ServiceUnavailable(ApiError):
    status = 503
    type = "server_error"
    code = "service_unavailable"


class Timeout(ApiError):
    status = 504
    type = "server_error"
    code = "timeout"


_BUS_CODE_TO_ERROR: dict[str, type[ApiError]] = {
    ErrorCode.TIMEOUT: Timeout,
    ErrorCode.BAD_REQUEST: InvalidRequest,
    ErrorCode.WORKER_LOST: ServiceUnavailable,
    ErrorCode.OVERLOADED: Overloaded,
}


def from_bus_error(code: str, message: str) -> ApiError:
    """Translate an ErrorChunk's code into the HTTP error a non-streaming client receives."""
    cls = _BUS_CODE_TO_ERROR.get(code, ApiError)
    return cls(message, code=code)

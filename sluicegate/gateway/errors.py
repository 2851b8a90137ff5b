"""The one definition of OpenAI's error shape, and the handlers that map errors to it.

Every error the gateway answers is ``{"error": {"message", "type", "param", "code"}}`` with
the right status; Litestar's own errors (validation, 404 routes, body too large) are mapped
too, so a client never sees Litestar's default body.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException
from litestar.status_codes import HTTP_500_INTERNAL_SERVER_ERROR

logger = logging.getLogger(__name__)


class OpenAIError(Exception):
    status_code: int = 400
    error_type: str = "invalid_request_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        error_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        if error_type is not None:
            self.error_type = error_type
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        # 5xx messages carry what a backend said; they never show a client where it lives.
        message = redact(self.message) if self.status_code >= 500 else self.message
        return error_body(message, self.error_type, self.param, self.code)


_URL = re.compile(r"\b[a-z][a-z0-9+.-]*://[^\s'\"<>()]+", re.IGNORECASE)
_HOST_PORT = re.compile(
    r"\(?'?\b(?:\d{1,3}(?:\.\d{1,3}){3}|localhost|[a-z0-9-]+(?:\.[a-z0-9-]+)+)'?"
    r"(?:(?::|',\s*)\d{1,5})\)?",
    re.IGNORECASE,
)
_SECRET = re.compile(
    r"\b(?:sk-[\w*.-]{4,}|AIza[\w-]{20,})|\bBearer\s+\S+"
    r"|\b(?:api[_-]?key|token|password|secret)=\S+",
    re.IGNORECASE,
)


def redact(message: str) -> str:
    """The message without URLs, host:port addresses or anything that looks like a key."""
    message = _URL.sub("[address]", message)
    message = _SECRET.sub("[redacted]", message)
    return _HOST_PORT.sub("[address]", message)


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


class InvalidRequest(OpenAIError):
    status_code = 400
    error_type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class AuthenticationFailed(OpenAIError):
    status_code = 401
    error_type = "invalid_request_error"
    code = "invalid_api_key"


class PermissionDenied(OpenAIError):
    status_code = 403
    error_type = "permission_error"
    code = "model_not_allowed"


class NotFound(OpenAIError):
    status_code = 404
    error_type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class Conflict(OpenAIError):
    status_code = 409
    error_type = "invalid_request_error"
    code = "conflict"


class PayloadTooLarge(OpenAIError):
    status_code = 413
    code = "request_too_large"


class RateLimited(OpenAIError):
    """429 with ``type`` naming the exhausted limit (``requests`` or ``tokens``)."""

    status_code = 429
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, limit: str, retry_after_s: float, **kwargs: Any) -> None:
        headers = {"retry-after": str(max(1, round(retry_after_s + 0.499)))}
        headers.update(kwargs.pop("headers", None) or {})
        super().__init__(message, error_type=limit, headers=headers, **kwargs)


class QuotaExceeded(OpenAIError):
    status_code = 429
    error_type = "insufficient_quota"
    code = "insufficient_quota"

    def __init__(self, message: str, **kwargs: Any) -> None:
        headers = {"x-should-retry": "false"}
        headers.update(kwargs.pop("headers", None) or {})
        super().__init__(message, headers=headers, **kwargs)


class ServiceUnavailable(OpenAIError):
    status_code = 503
    error_type = "service_unavailable"
    code = "service_unavailable"


class UpstreamError(OpenAIError):
    status_code = 502
    error_type = "upstream_error"
    code = "upstream_error"


def _response(
    status: int, body: dict[str, Any], headers: dict[str, str] | None = None
) -> Response[Any]:
    return Response(
        content=body, status_code=status, headers=headers or {}, media_type="application/json"
    )


def openai_error_handler(_: Request[Any, Any, Any], exc: OpenAIError) -> Response[Any]:
    return _response(exc.status_code, exc.body(), exc.headers)


_MISSING_FIELD = re.compile(r"missing required field `([^`]+)`")


def _validation_param(exc: ValidationException) -> str | None:
    extra = exc.extra
    if isinstance(extra, list) and extra and isinstance(extra[0], dict):
        key = extra[0].get("key")
        if isinstance(key, str) and key:
            path = key.removeprefix("$.")
            # Litestar names the object that lacks a field ("data" for the body itself);
            # OpenAI's param names the missing field.
            missing = _MISSING_FIELD.search(str(extra[0].get("message", "")))
            if missing:
                field = missing.group(1)
                return field if path in {"data", "$"} else f"{path}.{field}"
            return path
    return None


def validation_error_handler(_: Request[Any, Any, Any], exc: ValidationException) -> Response[Any]:
    param = _validation_param(exc)
    detail = exc.extra[0].get("message") if isinstance(exc.extra, list) and exc.extra else None
    message = f"Invalid value for '{param}': {detail}" if param and detail else exc.detail
    return _response(400, error_body(message, "invalid_request_error", param, None))


_HTTP_CODES: dict[int, tuple[str, str | None]] = {
    401: ("invalid_request_error", "invalid_api_key"),
    403: ("permission_error", None),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_exceeded", "rate_limit_exceeded"),
    503: ("service_unavailable", "service_unavailable"),
}


def http_error_handler(_: Request[Any, Any, Any], exc: HTTPException) -> Response[Any]:
    error_type, code = _HTTP_CODES.get(exc.status_code, ("invalid_request_error", None))
    if exc.status_code >= 500:
        error_type = "server_error"
    return _response(exc.status_code, error_body(exc.detail, error_type, None, code), exc.headers)


def internal_error_handler(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return _response(
        HTTP_500_INTERNAL_SERVER_ERROR,
        error_body("The server had an error while processing your request.", "server_error"),
    )

"""Errors in Anthropic's shape, for the controllers of Anthropic's API.

``{"type": "error", "error": {"type", "message"}}`` with Anthropic's types and statuses. The
lifecycle raises the gateway's domain errors (``OpenAIError`` subclasses, named after the API
the gateway first spoke); these handlers, set on Anthropic's controllers, render them in the
caller's API instead, so one error means the same status whichever API it came in by.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException

from sluicegate.gateway.errors import OpenAIError, redact, validation_error_handler

logger = logging.getLogger(__name__)

OVERLOADED = 529

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    OVERLOADED: "overloaded_error",
}


def anthropic_status(status: int) -> int:
    """Anthropic's status for ours: no deployment able to serve is its 529 (overloaded);
    other 5xx are its 500 (api_error); 4xx keep theirs."""
    if status == 503:
        return OVERLOADED
    if status >= 500:
        return 500
    return status if status in _TYPES else 400


def anthropic_body(status: int, message: str) -> dict[str, Any]:
    kind = _TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def anthropic_error(exc: OpenAIError) -> tuple[int, dict[str, Any]]:
    status = anthropic_status(exc.status_code)
    message = exc.body()["error"]["message"]
    if exc.param and exc.status_code == 400 and exc.param not in message:
        message = f"{exc.param}: {message}"
    return status, anthropic_body(status, message)


def _json(
    status: int, body: dict[str, Any], headers: dict[str, str] | None = None
) -> Response[Any]:
    return Response(
        msgspec.json.encode(body),
        status_code=status,
        headers=headers or {},
        media_type="application/json",
    )


def domain_error_handler(_: Request[Any, Any, Any], exc: OpenAIError) -> Response[Any]:
    status, body = anthropic_error(exc)
    return _json(status, body, exc.headers)


def validation_handler(request: Request[Any, Any, Any], exc: ValidationException) -> Response[Any]:
    # The OpenAI handler already names the field at fault; only the shape differs.
    openai = validation_error_handler(request, exc).content
    message = openai["error"]["message"] if isinstance(openai, dict) else str(exc.detail)
    return _json(400, anthropic_body(400, message))


def http_error_handler(_: Request[Any, Any, Any], exc: HTTPException) -> Response[Any]:
    status = anthropic_status(exc.status_code)
    return _json(status, anthropic_body(status, redact(exc.detail)), exc.headers)


def internal_error_handler(request: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    message = "The server had an error while processing your request."
    return _json(500, anthropic_body(500, message))


ANTHROPIC_EXCEPTION_HANDLERS: dict[type[Exception], Any] = {
    OpenAIError: domain_error_handler,
    ValidationException: validation_handler,
    HTTPException: http_error_handler,
    Exception: internal_error_handler,
}

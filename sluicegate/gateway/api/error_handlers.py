"""The app's exception handlers: errors raised before any controller matched (a 405, an unknown
path) answer in the API the caller speaks, told by the path; controllers set their own."""

from __future__ import annotations

from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException

from sluicegate.gateway import errors
from sluicegate.gateway.api import anthropic_errors

ANTHROPIC_PATH = "/v1/messages"


def _anthropic_route(path: str) -> bool:
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def http_error_handler(request: Request[Any, Any, Any], exc: HTTPException) -> Response[Any]:
    if _anthropic_route(request.url.path):
        return anthropic_errors.http_error_handler(request, exc)
    return errors.http_error_handler(request, exc)


EXCEPTION_HANDLERS: dict[type[Exception], Any] = {
    errors.OpenAIError: errors.openai_error_handler,
    ValidationException: errors.validation_error_handler,
    HTTPException: http_error_handler,
    Exception: errors.internal_error_handler,
}

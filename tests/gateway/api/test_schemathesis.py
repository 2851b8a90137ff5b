"""Property-based fuzzing of every /v1 and /admin operation in the gateway's own OpenAPI schema.

Schemathesis generates requests from the schema (valid and invalid bodies, parameters); each
goes to the real gateway (uvicorn, PostgreSQL, Redis, the fake OpenAI upstream) with a real
key. However odd the request, the answer is never a 5xx, and every error is in the API's own
shape: OpenAI's ``{"error": {"message", "type", "param", "code"}}``, or Anthropic's
``{"type": "error", "error": {"type", "message"}}`` on its routes. Operations that name a
``model`` get a routed one, so bodies reach generation rather than a 404.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from sluicegate.gateway.settings import Settings

EXAMPLES_PER_OPERATION = 10
"""Random examples per operation, after the boundary cases schemathesis derives from the schema
(its coverage phase: limits, overflows, wrong types, unexpected methods)."""


@pytest.fixture(scope="module")
def gateway_schema(gateway: str, api_settings: Settings) -> Any:
    admin = {"authorization": f"Bearer {api_settings.master_key}"}
    raw = httpx.get(f"{gateway}/schema/openapi.json", headers=admin).json()
    return schemathesis.openapi.from_dict(raw).include(path_regex="^/(v1|admin)/")


@pytest.fixture(scope="module")
def api_key(make_key: Callable[..., str]) -> str:
    return make_key()


schema = schemathesis.pytest.from_fixture("gateway_schema")


ANTHROPIC_PATHS = ("/v1/messages",)
MODEL_FOR_PATH = {"/v1/embeddings": "embed"}
"""The routed model each operation gets (``echo`` where not named here)."""


def _error_shape_problem(path: str, response: Any) -> str | None:
    """What is wrong with an error body: OpenAI's shape, or Anthropic's on its routes."""
    try:
        body = json.loads(response.content)
    except ValueError:
        return "the error body is not JSON"
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return "no 'error' object"
    if not isinstance(error.get("message"), str) or not error["message"]:
        return "no error.message"
    if not isinstance(error.get("type"), str):
        return "no error.type"
    if path.startswith(ANTHROPIC_PATHS):
        return None if body.get("type") == "error" else "Anthropic's top-level type is not 'error'"
    if "param" not in error or "code" not in error:
        return "error.param or error.code missing"
    return None


@schema.parametrize()
@settings(
    max_examples=EXAMPLES_PER_OPERATION,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_no_server_errors_and_errors_in_the_api_shape(
    case: Any, gateway: str, api_settings: Settings, api_key: str
) -> None:
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = MODEL_FOR_PATH.get(case.path, "echo")
    key = api_settings.master_key if case.path.startswith("/admin") else api_key
    headers = {"authorization": f"Bearer {key}", "x-api-key": key}
    response = case.call(base_url=gateway, headers=headers, timeout=30)
    described = (
        f"{case.method} {case.formatted_path} -> {response.status_code}: {response.text[:500]}"
    )
    assert response.status_code < 500, described
    if response.status_code >= 400:
        problem = _error_shape_problem(case.path, response)
        assert problem is None, f"{problem}: {described}"

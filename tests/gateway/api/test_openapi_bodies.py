"""The generation endpoints read their raw body, yet the OpenAPI document declares it: the JSON
Schema of the very type each handler decodes into, so clients and fuzzers see what is accepted."""

from __future__ import annotations

from typing import Any

import httpx
import jsonschema
import pytest

from sluicegate.gateway.settings import Settings

BODIES = {
    "/v1/chat/completions": {"model": "echo", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"model": "echo", "prompt": "hi"},
    "/v1/embeddings": {"model": "embed", "input": "hi"},
    "/v1/responses": {"model": "echo", "input": "hi"},
}


@pytest.fixture(scope="module")
def document(gateway: str, api_settings: Settings) -> dict[str, Any]:
    admin = {"authorization": f"Bearer {api_settings.master_key}"}
    response = httpx.get(f"{gateway}/schema/openapi.json", headers=admin)
    assert response.status_code == 200
    body: dict[str, Any] = response.json()
    return body


@pytest.mark.parametrize("path", list(BODIES))
def test_the_request_body_is_declared_and_matches_what_is_accepted(
    path: str, document: dict[str, Any], gateway: str, make_key: Any
) -> None:
    body = document["paths"][path]["post"]["requestBody"]
    assert body["required"] is True
    schema = body["content"]["application/json"]["schema"]
    assert "$ref" not in str(schema), "every definition is inlined"
    assert {"model"} <= set(schema["required"])
    jsonschema.validate(BODIES[path], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"messages": "not a list", "prompt": 5, "input": 5}, schema)
    # What the document accepts, the handler accepts.
    key = make_key()
    answer = httpx.post(
        gateway + path, json=BODIES[path], headers={"authorization": f"Bearer {key}"}, timeout=30
    )
    assert answer.status_code == 200, answer.text

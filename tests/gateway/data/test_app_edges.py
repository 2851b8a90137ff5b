"""The gateway's outer edges: schema and metrics exposure, CORS, body size and JSON depth."""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from sluicegate.gateway.app import create_asgi_app
from sluicegate.gateway.settings import Settings
from tests.gateway.api.servers import ServerThread, free_port

ORIGIN = "https://console.example.com"


@pytest.fixture
def edge_settings(gateway_settings: Settings, routing_yaml: Path) -> Settings:
    return dataclasses.replace(gateway_settings, config=str(routing_yaml), max_body_bytes=64_000)


def _serve(settings: Settings) -> Iterator[str]:
    server = ServerThread(create_asgi_app(settings)).start()
    yield server.url
    server.stop()


@pytest.fixture
def gateway(edge_settings: Settings) -> Iterator[str]:
    yield from _serve(edge_settings)


@pytest.fixture
async def api_key(gateway: str, edge_settings: Settings) -> AsyncIterator[str]:
    async with httpx.AsyncClient() as client:
        created = await client.post(
            f"{gateway}/admin/keys",
            json={"name": "edges"},
            headers={"authorization": f"Bearer {edge_settings.master_key}"},
        )
    assert created.status_code == 201, created.text
    yield created.json()["key"]


def _admin(settings: Settings) -> dict[str, str]:
    return {"authorization": f"Bearer {settings.master_key}"}


def test_schema_and_metrics_need_the_admin_key_by_default(
    gateway: str, edge_settings: Settings
) -> None:
    for path in ("/schema/openapi.json", "/schema", "/metrics"):
        refused = httpx.get(gateway + path)
        assert refused.status_code == 401, path
        assert refused.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(gateway + path, headers=_admin(edge_settings)).status_code == 200, path
    paths = httpx.get(f"{gateway}/schema/openapi.json", headers=_admin(edge_settings)).json()
    assert "/v1/chat/completions" in paths["paths"]
    assert not any(p.startswith("/schema") for p in paths["paths"])


def test_expose_schema_and_a_metrics_port(edge_settings: Settings) -> None:
    metrics_port = free_port()
    settings = dataclasses.replace(edge_settings, expose_schema=True, metrics_port=metrics_port)
    for url in _serve(settings):
        assert httpx.get(f"{url}/schema/openapi.json").status_code == 200
        assert httpx.get(f"{url}/metrics", headers=_admin(settings)).status_code == 404
        scraped = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics")
        assert scraped.status_code == 200
        assert "sluicegate_requests" in scraped.text
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", metrics_port)) != 0, "stopped with the app"


def test_cors_answers_only_allowed_origins(edge_settings: Settings) -> None:
    preflight = {
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type",
    }
    for url in _serve(edge_settings):
        plain = httpx.options(f"{url}/v1/models", headers={"origin": ORIGIN, **preflight})
        assert "access-control-allow-origin" not in plain.headers
    settings = dataclasses.replace(edge_settings, cors_allow_origins=f"{ORIGIN}, https://b.test")
    for url in _serve(settings):
        allowed = httpx.options(
            f"{url}/v1/chat/completions", headers={"origin": ORIGIN, **preflight}
        )
        assert allowed.status_code in (200, 204), allowed.text
        assert allowed.headers["access-control-allow-origin"] == ORIGIN
        assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
        other = httpx.get(f"{url}/health/live", headers={"origin": "https://evil.test"})
        assert "access-control-allow-origin" not in other.headers
        simple = httpx.get(f"{url}/health/live", headers={"origin": ORIGIN})
        assert simple.headers["access-control-allow-origin"] == ORIGIN


async def test_chunked_body_over_the_limit_is_413(
    gateway: str, api_key: str, edge_settings: Settings
) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
        for _ in range(edge_settings.max_body_bytes // 1000 + 10):
            yield b"x" * 1000
        yield b'"}]}'

    async with httpx.AsyncClient() as client:
        response = await client.post(
            f"{gateway}/v1/chat/completions",
            content=chunks(),
            headers={"authorization": f"Bearer {api_key}", "content-type": "application/json"},
        )
    assert "content-length" not in response.request.headers
    assert response.status_code == 413, response.text
    assert response.json()["error"]["code"] == "request_too_large"


async def test_deeply_nested_json_is_a_400_not_a_500(
    gateway: str, api_key: str, edge_settings: Settings
) -> None:
    deep = "[" * 5000 + "]" * 5000
    user = {"authorization": f"Bearer {api_key}", "content-type": "application/json"}
    async with httpx.AsyncClient() as client:
        for path, headers, body, field in [
            (
                "/v1/chat/completions",
                user,
                '{"model": "tiny", "messages": ' + deep + "}",
                "messages",
            ),
            (
                "/v1/completions",
                user,
                '{"model": "tiny", "prompt": "hi", "stop": ' + deep + "}",
                "stop",
            ),
            ("/admin/keys", {**user, **_admin(edge_settings)}, '{"name": ' + deep + "}", "name"),
            # Brackets and quotes inside strings, and a shallow field first, do not mislead it.
            (
                "/v1/chat/completions",
                user,
                '{"model": "t[{\\"", "user": "a]}", "metadata": {"k": ' + deep + "}}",
                "metadata",
            ),
            ("/v1/chat/completions", user, deep, None),  # no field: the body itself
        ]:
            response = await client.post(gateway + path, content=body, headers=headers)
            assert response.status_code == 400, (path, response.text)
            error = response.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert "nests deeper than" in error["message"]
            assert error["param"] == field, (path, error)
            if field is not None:
                assert f"'{field}'" in error["message"], error
        # Nesting within the limit is judged by the schema as usual, not by this check.
        shallow = "[" * 20 + "]" * 20
        response = await client.post(
            f"{gateway}/v1/completions",
            content='{"model": "tiny", "prompt": "hi", "stop": ' + shallow + "}",
            headers=user,
        )
        assert response.status_code == 400
        assert "nests deeper" not in response.text


async def test_nul_characters_in_admin_input_are_a_400_naming_the_field(
    gateway: str, edge_settings: Settings
) -> None:
    admin = {**_admin(edge_settings), "content-type": "application/json"}
    async with httpx.AsyncClient() as client:
        listed = await client.get(f"{gateway}/admin/audit?action=a%00b", headers=admin)
        assert listed.status_code == 400, listed.text
        assert listed.json()["error"]["param"] == "action"
        created = await client.post(
            f"{gateway}/admin/keys",
            content='{"name": "ok", "metadata": {"team": ["x", "a\\u0000b"]}}',
            headers=admin,
        )
        assert created.status_code == 400, created.text
        assert created.json()["error"]["param"] == "metadata.team.1"


def test_router_errors_on_anthropic_routes_are_in_anthropic_shape(gateway: str) -> None:
    for method, path in [("GET", "/v1/messages"), ("POST", "/v1/messages/nowhere")]:
        response = httpx.request(method, gateway + path, headers={"x-api-key": "sk-x"})
        assert response.status_code in (400, 404, 405), response.text
        body = response.json()
        assert body["type"] == "error", body
        assert body["error"]["type"] in ("not_found_error", "invalid_request_error"), body
    openai = httpx.get(f"{gateway}/v1/chat/completions")
    assert openai.status_code == 405
    assert openai.json()["error"]["code"] == "method_not_allowed"

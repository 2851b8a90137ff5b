"""The OpenAI-compatible adapter keeps upstream addresses to itself: out of INFO/WARNING logs
and out of what the client is told, whether the upstream is unreachable or answers a 4xx
whose message names a host."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from sluicegate.gateway.canonical import ChatRequest, text_message
from sluicegate.gateway.providers.base import ProviderError
from sluicegate.gateway.providers.hosted import Sessions
from sluicegate.gateway.providers.openai import OpenAIProvider

from ..api.servers import ServerThread, dead_port, read_body, serve_lifespan

LEAKY = "model 'm' is served at http://10.1.2.3:8000/v1 (proxy 10.1.2.3:8000), key sk-abcdef123456"


async def _leaky_upstream(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An OpenAI-compatible upstream whose 400 names where it lives and echoes a key."""
    if scope["type"] == "lifespan":
        await serve_lifespan(receive, send)
        return
    await read_body(receive)
    body = json.dumps({"error": {"message": LEAKY, "type": "invalid_request_error"}}).encode()
    headers = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": 400, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
async def sessions() -> AsyncIterator[Sessions]:
    shared = Sessions()
    yield shared
    await shared.close()


def _request() -> ChatRequest:
    return ChatRequest(model="m", messages=[text_message("user", "hi")])


async def _ask(provider: OpenAIProvider, stream: bool) -> None:
    if stream:
        async for _ in provider.generate(_request()):
            pass
    else:
        await provider.complete(_request())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_an_unreachable_upstream_is_logged_without_its_address(
    sessions: Sessions, caplog: pytest.LogCaptureFixture, stream: bool
) -> None:
    port = dead_port()
    provider = OpenAIProvider(
        name="dead-deployment",
        base_url=f"http://127.0.0.1:{port}/v1",
        model="m",
        sessions=sessions,
    )
    try:
        with caplog.at_level(logging.DEBUG, logger="sluicegate.gateway.providers"):
            with pytest.raises(ProviderError) as caught:
                await _ask(provider, stream)
    finally:
        await provider.close()
    assert caught.value.retryable and f"{port}" not in str(caught.value)
    loud = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert loud and all("dead-deployment" in line for line in loud)
    assert not any(f"{port}" in line for line in loud), loud


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_a_client_error_reaches_the_client_redacted(sessions: Sessions, stream: bool) -> None:
    server = ServerThread(_leaky_upstream).start()
    provider = OpenAIProvider(
        name="leaky", base_url=f"{server.url}/v1", model="m", sessions=sessions
    )
    try:
        with pytest.raises(ProviderError) as caught:
            await _ask(provider, stream)
    finally:
        await provider.close()
        server.stop()
    error = caught.value
    assert error.status_code == 400 and not error.retryable
    assert "model 'm' is served at" in error.message
    for secret in ("10.1.2.3", "8000", "sk-abcdef"):
        assert secret not in error.message, error.message

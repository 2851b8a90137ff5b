"""The one fallback loop, against real servers: a retry honouring retry-after, cross-model
fallbacks, and context-window fallbacks (by a deployment's declared window, and by a backend's
context-length error); the serving deployment named in a response header and usage."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest


def ask(gateway: tuple[str, str], model: str, text: str = "hi", **extra: Any) -> httpx.Response:
    url, key = gateway
    body = {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": text}]}
    return httpx.post(
        f"{url}/v1/messages",
        json=body | extra,
        headers={"x-api-key": key, "anthropic-version": "2023-06-01"},
        timeout=30,
    )


def test_429_is_retried_after_its_retry_after(
    hosted_gateway: tuple[str, str], fakes: dict[str, Any]
) -> None:
    app = fakes["anthropic"][0]
    calls = app.calls["once-limited"]
    started = time.perf_counter()
    response = ask(hosted_gateway, "retry-once")
    assert response.status_code == 200, response.text
    assert time.perf_counter() - started >= 0.3  # the upstream's retry-after-ms
    assert app.calls["once-limited"] == calls + 2
    assert response.headers["x-sluicegate-deployment"] == "anthropic:once-limited"


@pytest.mark.parametrize("stream", [False, True])
def test_cross_model_fallback(hosted_gateway: tuple[str, str], stream: bool) -> None:
    response = ask(hosted_gateway, "falls-back", stream=stream)
    assert response.status_code == 200, response.text
    assert response.headers["x-sluicegate-deployment"] == "gemini:plain"
    if stream:
        assert '"text":"w0 "' in response.text and '"text":"w1 "' in response.text
    else:
        assert response.json()["content"][0]["text"] == "w0 w1 "


def test_context_window_fallback_by_declared_window(hosted_gateway: tuple[str, str]) -> None:
    short = ask(hosted_gateway, "small-window", "a few words")
    assert short.headers["x-sluicegate-deployment"] == "small"
    long = ask(hosted_gateway, "small-window", "word " * 40)
    assert long.status_code == 200, long.text
    assert long.headers["x-sluicegate-deployment"] == "bedrock:plain"


def test_context_window_fallback_on_context_length_error(
    hosted_gateway: tuple[str, str],
) -> None:
    short = ask(hosted_gateway, "short-context", "two words")
    assert short.headers["x-sluicegate-deployment"] == "anthropic:short-context"
    long = ask(hosted_gateway, "short-context", "one two three four five")
    assert long.status_code == 200, long.text
    assert long.headers["x-sluicegate-deployment"] == "gemini:plain"

"""The one fallback loop, against real servers: a retry honouring retry-after, cross-model
fallbacks, and context-window fallbacks (by a deployment's declared window, and by a backend's
context-length error); an overload reported after a stream opened (before any output) moving
on like any failure before the first token, billed once; the serving deployment named in a
response header and usage."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from sluicegate.gateway.usage.stream import UsageEvent


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


def chat(gateway: tuple[str, str], model: str, stream: bool) -> httpx.Response:
    url, key = gateway
    body = {"model": model, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(
        f"{url}/v1/chat/completions",
        json=body | {"stream": stream},
        headers={"authorization": f"Bearer {key}"},
        timeout=30,
    )


def call(gateway: tuple[str, str], inbound: str, model: str, stream: bool) -> httpx.Response:
    if inbound == "anthropic":
        return ask(gateway, model, max_tokens=3, stream=stream)
    return chat(gateway, model, stream)


def answer_text(response: httpx.Response, inbound: str, stream: bool) -> str:
    if not stream:
        body = response.json()
        if inbound == "anthropic":
            return str(body["content"][0]["text"])
        return str(body["choices"][0]["message"]["content"])
    events = [
        json.loads(line[5:])
        for line in response.text.splitlines()
        if line.startswith("data:") and line[5:].strip() != "[DONE]"
    ]
    assert not [e for e in events if "error" in e], response.text
    if inbound == "anthropic":
        return "".join(e["delta"].get("text", "") for e in events if "delta" in e)
    return "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])


@pytest.mark.parametrize("inbound", ["anthropic", "openai"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_overload_after_the_stream_opened_moves_to_the_next_deployment(
    hosted_gateway: tuple[str, str],
    fakes: dict[str, Any],
    hosted_usage: Callable[..., list[UsageEvent]],
    inbound: str,
    stream: bool,
) -> None:
    # The first deployment sends message_start (no output), then an overloaded_error event:
    # nothing of its answer exists, so it is retried once, then the next deployment serves.
    app = fakes["anthropic"][0]
    calls = app.calls["opens-overloaded"]
    response = call(hosted_gateway, inbound, "opens-then-overloaded", stream)
    assert response.status_code == 200, response.text
    assert response.headers["x-sluicegate-deployment"] == "steady"
    assert answer_text(response, inbound, stream) == "w0 w1 w2 "
    assert app.calls["opens-overloaded"] == calls + 2
    (event,) = hosted_usage(response.headers["x-request-id"])
    assert (event.deployment, event.status, event.finish_reason) == ("steady", "ok", "length")
    # Billed once, exactly as the same request served by that deployment directly.
    direct = call(hosted_gateway, inbound, "anthropic-plain", stream)
    (plain,) = hosted_usage(direct.headers["x-request-id"])
    billed = (event.prompt_tokens, event.completion_tokens, event.cost_micros)
    assert billed == (plain.prompt_tokens, plain.completion_tokens, plain.cost_micros)
    assert event.completion_tokens == 3


@pytest.mark.parametrize("inbound", ["anthropic", "openai"])
def test_overload_after_the_stream_opened_with_no_other_deployment_is_an_error_unbilled(
    hosted_gateway: tuple[str, str],
    hosted_usage: Callable[..., list[UsageEvent]],
    inbound: str,
) -> None:
    # An HTTP error before any byte of the stream (not a 200 and an error event: 503, which
    # Anthropic's API says as 529 overloaded), billed nothing: no token was generated.
    response = call(hosted_gateway, inbound, "only-opens-then-overloaded", True)
    assert response.status_code == (529 if inbound == "anthropic" else 503), response.text
    (event,) = hosted_usage(response.headers["x-request-id"])
    assert event.status == "error" and event.ttft_ms is None
    assert (event.prompt_tokens, event.completion_tokens, event.cost_micros) == (0, 0, 0)


def test_openai_role_chunk_then_end_moves_on_and_the_role_chunk_still_reaches_the_client(
    hosted_gateway: tuple[str, str],
    fakes: dict[str, Any],
    hosted_usage: Callable[..., list[UsageEvent]],
) -> None:
    # azure-opens sends OpenAI's role-only first chunk, then ends its stream.
    app = fakes["azure"][0]
    calls = app.calls["cut-1"]
    response = chat(hosted_gateway, "azure-opens-then-drops", True)
    assert response.status_code == 200, response.text
    assert response.headers["x-sluicegate-deployment"] == "azure-steady"
    assert app.calls["cut-1"] == calls + 2
    first = json.loads(response.text.split("\n\n")[0].removeprefix("data: "))
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert answer_text(response, "openai", True) == "w0 w1 w2 "
    (event,) = hosted_usage(response.headers["x-request-id"])
    assert event.deployment == "azure-steady" and event.status == "ok"
    assert event.ttft_ms is not None and event.completion_tokens == 3


@pytest.mark.parametrize("model", ["anthropic-plain", "azure-plain"])
def test_a_stream_that_ends_with_no_output_is_served_and_billed(
    hosted_gateway: tuple[str, str],
    hosted_usage: Callable[..., list[UsageEvent]],
    model: str,
) -> None:
    # The stop sequence ends the fake's answer before its first word: the stream opens, then
    # finishes (with usage) without output. The finish is what commits it.
    url, key = hosted_gateway
    body = {
        "model": model,
        "max_tokens": 3,
        "stop": ["w0"],
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "hi"}],
    }
    response = httpx.post(
        f"{url}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {key}"},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    assert answer_text(response, "openai", True) == ""
    assert '"finish_reason":"stop"' in response.text.replace(" ", "")
    (event,) = hosted_usage(response.headers["x-request-id"])
    assert (event.status, event.finish_reason) == ("ok", "stop")
    assert event.prompt_tokens > 0 and event.ttft_ms is not None

"""Every hosted adapter driven through the gateway's inbound APIs — Anthropic's Messages API
(with the official ``anthropic`` SDK) and OpenAI's chat API (raw HTTP) — streamed and not,
tools, usage and errors."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import pytest

from .conftest import KINDS
from .fake_common import TOOL_ARGUMENTS

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


@pytest.mark.parametrize("kind", KINDS)
def test_anthropic_sdk_message_and_stream(claude: anthropic.Anthropic, kind: str) -> None:
    kwargs: dict[str, Any] = {
        "model": f"{kind}-plain",
        "max_tokens": 3,
        "system": "be brief",
        "messages": [{"role": "user", "content": "say some words"}],
    }
    message = claude.messages.create(**kwargs)
    assert message.content[0].type == "text" and message.content[0].text == "w0 w1 w2 "
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 3
    with claude.messages.stream(**kwargs) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == "w0 w1 w2 "
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 3
    assert final.usage.input_tokens == message.usage.input_tokens


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_anthropic_sdk_forced_tool_and_result(
    claude: anthropic.Anthropic, kind: str, stream: bool
) -> None:
    kwargs: dict[str, Any] = {
        "model": f"{kind}-plain",
        "max_tokens": 50,
        "tools": [WEATHER],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "messages": [{"role": "user", "content": "hello"}],
    }
    if stream:
        with claude.messages.stream(**kwargs) as events:
            message = events.get_final_message()
    else:
        message = claude.messages.create(**kwargs)
    assert message.stop_reason == "tool_use"
    (use,) = [b for b in message.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.input == TOOL_ARGUMENTS
    follow = claude.messages.create(
        model=f"{kind}-plain",
        max_tokens=50,
        tools=[WEATHER],
        messages=[
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": [use.model_dump()]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}],
            },
        ],
    )
    assert follow.stop_reason == "end_turn" and follow.content[0].text.startswith("w0")


@pytest.mark.parametrize("kind", KINDS)
def test_anthropic_errors_are_typed(claude: anthropic.Anthropic, kind: str) -> None:
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(
            model=f"{kind}-bad", max_tokens=5, messages=[{"role": "user", "content": "x"}]
        )
    assert bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(anthropic.InternalServerError) as overloaded:
        claude.messages.create(
            model=f"{kind}-limited", max_tokens=5, messages=[{"role": "user", "content": "x"}]
        )
    assert overloaded.value.status_code == 529
    assert "127.0.0.1" not in str(overloaded.value.body)


def test_anthropic_errors_for_key_and_model(
    claude: anthropic.Anthropic, hosted_gateway: tuple[str, str]
) -> None:
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(
            model="no-such-model", max_tokens=5, messages=[{"role": "user", "content": "x"}]
        )
    stranger = anthropic.Anthropic(base_url=hosted_gateway[0], api_key="sk-nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        stranger.messages.create(
            model="anthropic-plain", max_tokens=5, messages=[{"role": "user", "content": "x"}]
        )
    response = httpx.post(
        f"{hosted_gateway[0]}/v1/messages",
        headers={"x-api-key": hosted_gateway[1], "anthropic-version": "2023-06-01"},
        json={"model": "anthropic-plain", "max_tokens": 5, "messages": [], "bogus": 1},
    )
    assert response.status_code == 400
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert "bogus" in error["error"]["message"]


def test_rate_limited_deployment_falls_back(claude: anthropic.Anthropic) -> None:
    message = claude.messages.create(
        model="spread-limited", max_tokens=2, messages=[{"role": "user", "content": "x"}]
    )
    assert message.content[0].text == "w0 w1 "


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_openai_chat_through_each_adapter(
    hosted_gateway: tuple[str, str], kind: str, stream: bool
) -> None:
    url, key = hosted_gateway
    body = {
        "model": f"{kind}-plain",
        "max_tokens": 3,
        "messages": [{"role": "user", "content": "say some words"}],
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    response = httpx.post(
        f"{url}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
    )
    assert response.status_code == 200, response.text
    if stream:
        assert "w0 " in response.text and '"finish_reason":"length"' in response.text
    else:
        answer = response.json()
        assert answer["choices"][0]["message"]["content"] == "w0 w1 w2 "
        assert answer["choices"][0]["finish_reason"] == "length"
        assert answer["usage"]["completion_tokens"] == 3

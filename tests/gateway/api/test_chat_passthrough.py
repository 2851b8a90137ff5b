"""The whole chat API through a ``provider: openai`` deployment, with the official SDK.

The upstream (servers.py) records every body it receives: each field a client sends reaches it
unchanged (only ``model`` rewritten, and a stream asks for usage), unknown fields too; and its
tool calls, refusals, logprobs and several choices reach the client unchanged, streamed and not.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from . import rich_replies
from .servers import Upstream

IMAGE = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGBgAAAABQABpfZFQAAAAABJRU5ErkJggg=="
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
            "strict": True,
        },
    }
]
MESSAGES: list[dict[str, Any]] = [
    {"role": "developer", "content": "Be brief."},
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "What is in this image, and the weather in Paris?"},
            {"type": "image_url", "image_url": {"url": IMAGE, "detail": "low"}},
            {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
            {
                "type": "file",
                "file": {"filename": "a.pdf", "file_data": "data:application/pdf;base64,JVBERi0="},
            },
        ],
        "name": "ada",
    },
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]
FIELDS: dict[str, Any] = {
    "messages": MESSAGES,
    "tools": TOOLS,
    "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    "parallel_tool_calls": False,
    "response_format": {
        "type": "json_schema",
        "json_schema": {
            "name": "answer",
            "schema": {"type": "object", "properties": {"a": {"type": "string"}}},
            "strict": True,
        },
    },
    "logprobs": True,
    "top_logprobs": 3,
    "n": 2,
    "logit_bias": {"50256": -100, "15": 2},
    "seed": 42,
    "stop": ["\n\n", "END"],
    "max_completion_tokens": 64,
    "temperature": 0.3,
    "top_p": 0.9,
    "presence_penalty": 0.1,
    "frequency_penalty": 0.2,
    "reasoning_effort": "low",
    "metadata": {"team": "blue"},
    "user": "user-7",
    "service_tier": "flex",
    "store": True,
    "modalities": ["text", "audio"],
    "audio": {"voice": "alloy", "format": "wav"},
    "prediction": {"type": "content", "content": "The weather is"},
    "web_search_options": {"search_context_size": "low"},
    "verbosity": "low",
    "prompt_cache_key": "tenant-7",
    "safety_identifier": "hash-7",
}


def sdk(gateway: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0)


def _sent(upstream: Upstream, model: str) -> dict[str, Any]:
    return copy.deepcopy(upstream.last_body(model))


def test_every_field_reaches_the_upstream_unchanged(
    gateway: str, make_key: Callable[..., str], upstream: tuple[Upstream, str]
) -> None:
    client = sdk(gateway, make_key())
    # Unknown fields, at the top and inside known objects, go along too.
    nested = copy.deepcopy(FIELDS)
    nested["messages"][1]["content"][0]["cache_control"] = {"type": "ephemeral"}
    nested["tools"][0]["function"]["examples"] = [{"city": "Paris"}]
    client.chat.completions.create(
        model="echo-alias", extra_body={"vendor_knob": {"depth": 3}}, **nested
    )
    received = _sent(upstream[0], "echo")
    assert received.pop("model") == "echo"
    assert received.pop("vendor_knob") == {"depth": 3}
    assert "max_tokens" not in received, "the gateway must not invent max_tokens"
    assert received == nested


def test_every_field_of_a_stream_reaches_the_upstream_unchanged(
    gateway: str, make_key: Callable[..., str], upstream: tuple[Upstream, str]
) -> None:
    client = sdk(gateway, make_key())
    chunks = list(client.chat.completions.create(model="echo", stream=True, **FIELDS))
    assert chunks
    received = _sent(upstream[0], "echo")
    assert received.pop("model") == "echo"
    assert received.pop("stream") is True
    assert received.pop("stream_options") == {"include_usage": True}, "asked for billing"
    assert received == FIELDS


def test_a_stream_asks_the_upstream_for_usage_but_keeps_the_clients_options(
    gateway: str, make_key: Callable[..., str], upstream: tuple[Upstream, str]
) -> None:
    client = sdk(gateway, make_key())
    stream = client.chat.completions.create(
        model="echo",
        messages=[{"role": "user", "content": "hi"}],
        stream=True,
        stream_options={"include_obfuscation": False},
    )
    chunks = list(stream)
    received = _sent(upstream[0], "echo")
    assert received["stream_options"] == {"include_obfuscation": False, "include_usage": True}
    assert received["stream"] is True and "max_tokens" not in received
    # The client did not ask for usage: it sees no usage chunk and no usage fields.
    assert all(chunk.choices for chunk in chunks)
    assert all(chunk.usage is None for chunk in chunks)


def _relabelled(obj: dict[str, Any], request_id: str, model: str) -> dict[str, Any]:
    return {**obj, "id": f"chatcmpl-{request_id}", "model": model}


def test_rich_reply_reaches_the_client_unchanged(
    gateway: str, make_key: Callable[..., str], usage_events: Callable[..., list]
) -> None:
    key = make_key()
    response = httpx.post(
        f"{gateway}/v1/chat/completions",
        json={"model": "rich", "messages": [{"role": "user", "content": "hi"}], "n": 2},
        headers={"authorization": f"Bearer {key}"},
    )
    assert response.status_code == 200, response.text
    request_id = response.headers["x-request-id"]
    assert response.json() == _relabelled(rich_replies.COMPLETION, request_id, "rich")

    completion = sdk(gateway, key).chat.completions.create(
        model="rich", messages=[{"role": "user", "content": "hi"}], n=2, logprobs=True
    )
    first, second = completion.choices
    assert first.finish_reason == "tool_calls" and first.message.tool_calls is not None
    assert [c.function.name for c in first.message.tool_calls] == ["get_weather", "get_time"]
    assert json.loads(first.message.tool_calls[0].function.arguments) == {
        "city": "Paris",
        "unit": "c",
    }
    assert first.logprobs is not None and first.logprobs.content is not None
    assert first.logprobs.content[0].top_logprobs[1].token == "x"
    assert second.message.refusal == "I can't help with that."
    assert completion.system_fingerprint == rich_replies.FINGERPRINT
    assert completion.usage is not None
    assert completion.usage.prompt_tokens_details is not None
    assert completion.usage.prompt_tokens_details.cached_tokens == 8

    (event,) = usage_events(request_id)
    assert (event.prompt_tokens, event.completion_tokens, event.cached_tokens) == (31, 17, 8)
    assert event.finish_reason == "tool_calls"


@pytest.mark.parametrize("include_usage", [False, True])
def test_rich_stream_reaches_the_client_unchanged(
    gateway: str, make_key: Callable[..., str], include_usage: bool
) -> None:
    body: dict[str, Any] = {
        "model": "rich",
        "messages": [{"role": "user", "content": "hi"}],
        "n": 2,
        "stream": True,
    }
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    headers = {"authorization": f"Bearer {make_key()}"}
    with httpx.stream("POST", f"{gateway}/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        request_id = r.headers["x-request-id"]
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert events[-1] == "[DONE]"
    expected = [
        _relabelled(chunk, request_id, "rich") for chunk in rich_replies.chunks(include_usage)
    ]
    assert [json.loads(e) for e in events[:-1]] == expected


def test_the_sdk_assembles_the_streamed_tool_calls(
    gateway: str, make_key: Callable[..., str]
) -> None:
    client = sdk(gateway, make_key())
    with client.chat.completions.stream(
        model="rich", messages=[{"role": "user", "content": "hi"}], n=2
    ) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert calls is not None
    assert [(c.id, c.function.name, c.function.arguments) for c in calls] == [
        (t["id"], t["function"]["name"], t["function"]["arguments"])
        for t in rich_replies.TOOL_CALLS
    ]
    assert final.choices[1].message.refusal == "I can't help with that."

"""The official ``anthropic`` SDK and the ``openai`` SDK's Responses API, unchanged, against a
gateway and a real engine worker on the tiny demo model (Hermes-style tool template).

Acceptance 1 and 2 of issue 10: a message, a streamed message, a forced tool call whose input
validates against its schema, a tool_result follow-up, output_config.format output that
validates, count_tokens, typed errors; Responses streamed and not with a function tool.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import jsonschema
import pytest

from .conftest import Cluster, Gateway, create_key, model_name

pytestmark = pytest.mark.timeout(300)

# Enums keep a random model's constrained arguments short enough to finish.
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {"name": "get_weather", "description": "A forecast", "input_schema": WEATHER_SCHEMA}


@pytest.fixture(scope="module")
def model(cluster: Cluster, redis_url: str, gateway: Gateway) -> str:
    name = model_name("claude-tiny")
    cluster.worker(name, redis_url)
    gateway.wait_model(name)
    return name


@pytest.fixture(scope="module")
def claude(gateway: Gateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.base_url, api_key=gateway.api_key, max_retries=0)


def test_message_and_stream(claude: anthropic.Anthropic, model: str) -> None:
    kwargs: dict[str, Any] = {
        "model": model,
        "max_tokens": 8,
        "system": "You are terse.",
        "messages": [{"role": "user", "content": "Say something."}],
        # Today's SDK no longer types temperature; older clients send it, and it is honoured.
        "extra_body": {"temperature": 0.0},
    }
    message = claude.messages.create(**kwargs)
    assert message.type == "message" and message.role == "assistant"
    assert message.stop_reason in {"end_turn", "max_tokens"}
    assert 0 < message.usage.output_tokens <= 8 and message.usage.input_tokens > 0
    with claude.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    # Greedy: the streamed answer is the whole one.
    assert text == message.content[0].text  # type: ignore[union-attr]
    assert final.usage.output_tokens == message.usage.output_tokens


def test_forced_tool_call_validates_and_result_follow_up(
    claude: anthropic.Anthropic, model: str
) -> None:
    message = claude.messages.create(
        model=model,
        max_tokens=256,
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "Weather in Paris for 3 days?"}],
    )
    assert message.stop_reason == "tool_use"
    (use,) = [b for b in message.content if b.type == "tool_use"]
    assert use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER_SCHEMA)
    follow = claude.messages.create(
        model=model,
        max_tokens=8,
        tools=[WEATHER],  # type: ignore[list-item]
        messages=[
            {"role": "user", "content": "Weather in Paris for 3 days?"},
            {"role": "assistant", "content": [use.model_dump(exclude_none=True)]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}],
            },
        ],
    )
    assert follow.stop_reason in {"end_turn", "max_tokens", "tool_use"}

    def prompt(usage: Any) -> int:
        return int(usage.input_tokens + usage.cache_read_input_tokens)

    # The follow-up's prompt holds the call and its result (its prefix served from the cache).
    assert prompt(follow.usage) > prompt(message.usage)


def test_output_format_validates(claude: anthropic.Anthropic, model: str) -> None:
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    message = claude.messages.create(
        model=model,
        max_tokens=32,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        messages=[{"role": "user", "content": "Is the sky blue?"}],
    )
    jsonschema.validate(json.loads(message.content[0].text), schema)  # type: ignore[union-attr]


def test_count_tokens_matches_the_message_usage(claude: anthropic.Anthropic, model: str) -> None:
    messages: Any = [{"role": "user", "content": "Count these words, please."}]
    counted = claude.messages.count_tokens(model=model, messages=messages)
    message = claude.messages.create(model=model, max_tokens=2, messages=messages)
    usage = message.usage
    # Anthropic counts prompt tokens read from the cache apart from input_tokens.
    total = usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens
    assert counted.input_tokens == total > 0


def test_typed_errors(claude: anthropic.Anthropic, gateway: Gateway, model: str) -> None:
    hello: Any = [{"role": "user", "content": "hi"}]
    stranger = anthropic.Anthropic(base_url=gateway.base_url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        stranger.messages.create(model=model, max_tokens=2, messages=hello)
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="no-such-model", max_tokens=2, messages=hello)
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(
            model=model,
            max_tokens=2,
            messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}],  # type: ignore[list-item]
        )
    key, _ = create_key(gateway.base_url, "one-rpm", rpm_limit=1)
    limited = anthropic.Anthropic(base_url=gateway.base_url, api_key=key, max_retries=0)
    limited.messages.create(model=model, max_tokens=2, messages=hello)
    with pytest.raises(anthropic.RateLimitError) as caught:
        limited.messages.create(model=model, max_tokens=2, messages=hello)
    assert caught.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]


FUNCTION = {
    "type": "function",
    "name": "get_weather",
    "description": "A forecast",
    "parameters": WEATHER_SCHEMA,
    "strict": True,
}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_responses_with_a_function_tool(gateway: Gateway, model: str, stream: bool) -> None:
    client = gateway.openai(max_retries=0)
    kwargs: dict[str, Any] = {
        "model": model,
        "input": "Weather in Paris for 3 days?",
        "tools": [FUNCTION],
        "tool_choice": "required",
        "max_output_tokens": 256,
    }
    if stream:
        with client.responses.stream(**kwargs) as events:
            kinds = [event.type for event in events]
            response = events.get_final_response()
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        assert "response.function_call_arguments.delta" in kinds
    else:
        response = client.responses.create(**kwargs)
    (call,) = [item for item in response.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    assert response.usage is not None and response.usage.output_tokens > 0
    follow = client.responses.create(
        model=model,
        input=[
            {"role": "user", "content": "Weather in Paris for 3 days?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
        ],
        tools=[FUNCTION],  # type: ignore[list-item]
        max_output_tokens=8,
    )
    assert follow.status in {"completed", "incomplete"}


def test_responses_logprobs_when_included(gateway: Gateway, model: str) -> None:
    response = gateway.openai(max_retries=0).responses.create(
        model=model,
        input="Say something.",
        max_output_tokens=4,
        top_logprobs=2,
        include=["message.output_text.logprobs"],
    )
    (message,) = [item for item in response.output if item.type == "message"]
    logprobs = message.content[0].logprobs  # type: ignore[union-attr]
    assert logprobs is not None and len(logprobs) == response.usage.output_tokens  # type: ignore[union-attr]
    assert all(lp.logprob <= 0 and len(lp.top_logprobs) == 2 for lp in logprobs)


def test_thinking_on_a_model_without_a_thinking_mode_is_a_400(
    claude: anthropic.Anthropic, model: str
) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(
            model=model,
            max_tokens=2048,
            thinking={"type": "enabled", "budget_tokens": 1024},
            messages=[{"role": "user", "content": "hi"}],
        )
    assert "thinking" in caught.value.body["error"]["message"]  # type: ignore[index]
    message = claude.messages.create(
        model=model,
        max_tokens=2,
        thinking={"type": "disabled"},
        messages=[{"role": "user", "content": "hi"}],
    )
    assert message.usage.output_tokens > 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_stop_sequence_is_reported(claude: anthropic.Anthropic, model: str, stream: bool) -> None:
    kwargs: dict[str, Any] = {
        "model": model,
        "max_tokens": 12,
        "messages": [{"role": "user", "content": "Say something."}],
        "extra_body": {"temperature": 0.0},
    }
    free = claude.messages.create(**kwargs)
    text = free.content[0].text  # type: ignore[union-attr]
    stop = text[len(text) // 2 :][:2]
    assert stop.strip(), text
    kwargs["stop_sequences"] = [stop]
    if stream:
        with claude.messages.stream(**kwargs) as events:
            message = events.get_final_message()
    else:
        message = claude.messages.create(**kwargs)
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert stop not in message.content[0].text  # type: ignore[union-attr]
    assert text.startswith(message.content[0].text)  # type: ignore[union-attr]

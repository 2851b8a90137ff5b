"""The official ``anthropic`` SDK and the ``openai`` SDK's Responses API, unchanged, against
``sluicegate up`` on its demo model (random weights, a Hermes-style tool template), the
session's one ``up`` process (tests/e2e/conftest.py).

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

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]

# Enums keep a random model's constrained arguments short enough to finish.
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER = {"name": "get_weather", "description": "A forecast", "input_schema": WEATHER_SCHEMA}


@pytest.fixture(scope="module")
def model(up: Any) -> str:
    return str(up.model)


@pytest.fixture(scope="module")
def claude(up: Any) -> anthropic.Anthropic:
    client: anthropic.Anthropic = up.anthropic()
    return client


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


def test_count_tokens_counts_system_and_tools(claude: anthropic.Anthropic, model: str) -> None:
    messages: Any = [{"role": "user", "content": "Count these words, please."}]
    system = "You are a weather service."

    def prompt_of(message: Any) -> int:
        # Anthropic counts prompt tokens read from the cache apart from input_tokens.
        usage = message.usage
        return int(
            usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens
        )

    counted = claude.messages.count_tokens(model=model, messages=messages)
    assert counted.model_dump() == {"input_tokens": counted.input_tokens}
    message = claude.messages.create(model=model, max_tokens=2, messages=messages)
    assert counted.input_tokens == prompt_of(message) > 0

    with_system = claude.messages.count_tokens(model=model, system=system, messages=messages)
    with_tools = claude.messages.count_tokens(
        model=model,
        system=system,
        tools=[WEATHER],  # type: ignore[list-item]
        messages=messages,
    )
    assert counted.input_tokens < with_system.input_tokens < with_tools.input_tokens
    message = claude.messages.create(
        model=model,
        max_tokens=2,
        system=system,
        tools=[WEATHER],  # type: ignore[list-item]
        messages=messages,
    )
    # The tools' definitions are in the rendered prompt, as the engine renders it to generate.
    assert with_tools.input_tokens == prompt_of(message)


def test_typed_errors(claude: anthropic.Anthropic, up: Any, model: str) -> None:
    hello: Any = [{"role": "user", "content": "hi"}]
    stranger = up.anthropic(api_key="sk-wrong")
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
    # A key of its own through the admin API, allowed one request a minute.
    limited = up.anthropic(api_key=up.create_key("one-rpm", rpm_limit=1))
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
def test_responses_with_a_function_tool(up: Any, model: str, stream: bool) -> None:
    client = up.openai(max_retries=0)
    kwargs: dict[str, Any] = {
        "model": model,
        "input": "Weather in Paris for 3 days?",
        "tools": [FUNCTION],
        "tool_choice": "required",
        "max_output_tokens": 256,
    }
    if stream:
        events = list(client.responses.create(stream=True, **kwargs))
        kinds = [event.type for event in events]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        assert "response.function_call_arguments.delta" in kinds
        response = events[-1].response
        streamed = "".join(
            e.delta for e in events if e.type == "response.function_call_arguments.delta"
        )
        (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert streamed == done.arguments
    else:
        response = client.responses.create(**kwargs)
    assert response.status == "completed"
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


def test_responses_logprobs_when_included(up: Any, model: str) -> None:
    response = up.openai(max_retries=0).responses.create(
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


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_stored_responses_chain_three_turns_on_the_engine(
    up: Any, model: str, stream: bool
) -> None:
    """``store`` left out stores (as OpenAI's); each turn continues the last by
    ``previous_response_id`` at once, and the engine reads the whole conversation."""
    client = up.openai(max_retries=0)
    turns: list[Any] = []
    for text in ("One.", "Two.", "Three."):
        kwargs: dict[str, Any] = {"model": model, "input": text, "max_output_tokens": 4}
        if turns:
            kwargs["previous_response_id"] = turns[-1].id
        if stream:
            events = list(client.responses.create(stream=True, **kwargs))
            turns.append(events[-1].response)
        else:
            turns.append(client.responses.create(**kwargs))
    prompts = [turn.usage.input_tokens for turn in turns]
    assert prompts == sorted(set(prompts)), prompts  # each holds the one before it
    items = client.responses.input_items.list(turns[-1].id, order="asc").data
    said = [(item.role, item.content[0].text) for item in items]  # type: ignore[union-attr]
    assert [text for role, text in said if role == "user"] == ["One.", "Two.", "Three."]
    assert [i.id for i in items if i.role == "assistant"] == [
        item.id
        for turn in turns[:2]
        for item in turn.output
        if item.type == "message" and any(part.text for part in item.content)
    ]  # an empty answer is not read back: it would be an empty assistant turn
    assert client.responses.retrieve(turns[-1].id).output_text == turns[-1].output_text


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

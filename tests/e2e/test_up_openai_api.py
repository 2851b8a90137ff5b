"""Issue 9, acceptance 1: the official ``openai`` SDK, unchanged, against ``sluicegate up`` on
the demo model (random weights, a Hermes-style chat template with tools): forced tool calls that
validate, the follow-up turn, streaming equal to non-streaming, ``parse()`` with a Pydantic
model, logprobs and seeded ``n``."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any, Literal

import jsonschema
import pytest
from pydantic import BaseModel

pytestmark = [pytest.mark.timeout(400), pytest.mark.slow]

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
NAMED: Any = {"type": "function", "function": {"name": "get_weather"}}
MESSAGES: Any = [{"role": "user", "content": "Weather in Paris?"}]


SCHEMAS: list[Any] = [
    WEATHER,
    {  # nested objects, arrays, enums, required fields, no additional properties
        "type": "object",
        "properties": {
            "open": {"type": "boolean"},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
            "keeper": {
                "type": "object",
                "properties": {
                    "level": {"enum": [1, 2, 3]},
                    "name": {"type": "string", "maxLength": 4},
                },
                "required": ["level"],
                "additionalProperties": False,
            },
        },
        "required": ["open", "tags", "keeper"],
        "additionalProperties": False,
    },
    {"type": "object", "properties": {"pick": {"enum": ["x", "y", "z"]}}, "required": ["pick"]},
]


class Gate(BaseModel):
    kind: Literal["river", "gate", "weir"]
    open: bool
    level: Literal[1, 2, 3]


@pytest.fixture(scope="module")
def served(up: Any) -> SimpleNamespace:
    """The session's ``sluicegate up`` (tests/e2e/conftest.py), seen through the openai SDK."""
    return SimpleNamespace(client=up.openai(), model=up.model, model_dir=up.model_dir)


def test_named_tool_call_validates_streams_the_same_and_takes_the_follow_up(served: Any) -> None:
    client, model = served.client, served.model
    reply = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=NAMED,
        max_tokens=200,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)

    stream = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice=NAMED,
        max_tokens=200,
        temperature=0,
        stream=True,
    )
    content, name, arguments, finish = "", None, "", None
    for event in stream:
        for streamed in event.choices:
            content += streamed.delta.content or ""
            for fragment in streamed.delta.tool_calls or []:
                if fragment.function and fragment.function.name:
                    name = fragment.function.name
                arguments += (fragment.function.arguments or "") if fragment.function else ""
            finish = streamed.finish_reason or finish
    assert (content, name, arguments, finish) == (
        "",
        "get_weather",
        call.function.arguments,
        "tool_calls",
    )

    follow_up = [
        *MESSAGES,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    answer = client.chat.completions.create(
        model=model, messages=follow_up, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_required_tool_choice_returns_a_valid_call(served: Any) -> None:
    for seed in (1, 2):
        reply = served.client.chat.completions.create(
            model=served.model,
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice="required",
            max_tokens=200,
            temperature=1.0,
            seed=seed,
        )
        assert reply.choices[0].finish_reason == "tool_calls"
        (call,) = reply.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_parse_with_a_pydantic_model(served: Any) -> None:
    completion = served.client.chat.completions.parse(
        model=served.model, messages=MESSAGES, response_format=Gate, max_tokens=100, temperature=0
    )
    assert isinstance(completion.choices[0].message.parsed, Gate)


@pytest.mark.parametrize("schema", SCHEMAS)
def test_json_schema_output_validates(served: Any, schema: Any) -> None:
    completion = served.client.chat.completions.create(
        model=served.model,
        messages=MESSAGES,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "out", "schema": schema, "strict": True},
        },
        max_tokens=120,
        temperature=0,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content or ""), schema)


def test_logprobs_and_seeded_n(served: Any) -> None:
    client, model = served.client, served.model
    reply = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        logprobs=True,
        top_logprobs=3,
        max_tokens=4,
        temperature=0,
    )
    entries = reply.choices[0].logprobs.content
    assert len(entries) == reply.usage.completion_tokens
    # The engine's own log-softmax, in process on the same weights and prompt.
    from sluicegate.engine import LLM, SamplingParams

    llm = LLM(str(served.model_dir), num_kv_blocks=64)
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=3)
    (own,) = llm.chat(MESSAGES, params)
    assert own.logprobs is not None and len(own.logprobs) == len(entries)
    for entry, expected in zip(entries, own.logprobs, strict=True):
        assert bytes(entry.bytes or []) == llm.tokenizer.token_bytes(expected.token_id)
        assert entry.logprob == pytest.approx(expected.logprob, abs=1e-4)
        tops = [(bytes(t.bytes or []), t.logprob) for t in entry.top_logprobs]
        assert tops == [
            (llm.tokenizer.token_bytes(t), pytest.approx(lp, abs=1e-4)) for t, lp in expected.top
        ]

    def three() -> Any:
        return client.chat.completions.create(
            model=model, messages=MESSAGES, n=3, max_tokens=6, temperature=1.0, seed=7
        )

    first, second = three(), three()
    single = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in second.choices]
    assert first.usage.prompt_tokens == single.usage.prompt_tokens, "the prompt counted once"
    assert first.usage.completion_tokens == 18

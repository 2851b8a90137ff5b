"""Issue 9's acceptance 1: the official ``openai`` SDK, unchanged, against a gateway in front of
an engine worker serving the tiny demo model (random weights, Hermes-style chat template).

Its answers are nonsense, which is the point: named and required tool choices, JSON schemas and
Pydantic ``parse()`` are enforced by constrained decoding, so even this model's output
validates; logprobs agree with the engine's own; ``n`` choices are seeded and reproducible; the
streamed form assembles to the non-streamed one under greedy decoding.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any, Literal

import jsonschema
import pydantic
import pytest

pytestmark = pytest.mark.timeout(300)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Lima", "Oslo"]},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "days": {"type": "integer", "enum": [1, 2, 3]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 120}
SCHEMAS: list[dict[str, Any]] = [
    WEATHER,
    {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "tags": {
                "type": "array",
                "items": {"type": "string", "enum": ["a", "b"]},
                "maxItems": 2,
            },
            "inner": {
                "type": "object",
                "properties": {"level": {"type": "string", "enum": ["low", "high"]}},
                "required": ["level"],
                "additionalProperties": False,
            },
        },
        "required": ["ok", "tags", "inner"],
        "additionalProperties": False,
    },
    {"type": "object", "properties": {"pick": {"enum": ["x", "y", "z"]}}, "required": ["pick"]},
]


class Forecast(pydantic.BaseModel):
    city: Literal["Paris", "Lima"]
    rain: bool


@pytest.fixture(scope="module")
def served(cluster: Any, gateway: Any, redis_url: str, tools: SimpleNamespace) -> SimpleNamespace:
    name = tools.model_name("e2e-chat-api")
    cluster.worker(name, redis_url)
    gateway.wait_model(name)
    return SimpleNamespace(model=name, client=gateway.openai(max_retries=0, timeout=120))


def _validate_calls(calls: Any) -> list[tuple[str, dict[str, Any]]]:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    out = []
    assert calls, "a tool call was required"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, schemas[call.function.name])
        out.append((call.function.name, arguments))
    return out


def test_named_tool_choice_then_the_tool_result_turn(served: SimpleNamespace) -> None:
    client = served.client
    completion = client.chat.completions.create(
        model=served.model,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        **GREEDY,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    (name, _), *_ = _validate_calls(choice.message.tool_calls)
    assert name == "get_weather"
    call = choice.message.tool_calls[0]
    follow_up = client.chat.completions.create(
        model=served.model,
        messages=[
            *ASK,
            choice.message,  # the SDK's own object, sent back as history
            {"role": "tool", "tool_call_id": call.id, "content": '{"temp_c": 21}'},
        ],
        tools=TOOLS,
        max_tokens=8,
        temperature=0,
    )
    assert follow_up.choices[0].finish_reason in {"stop", "length", "tool_calls"}


def test_required_tool_choice_streamed_equals_not_streamed(served: SimpleNamespace) -> None:
    client = served.client
    kwargs: dict[str, Any] = {
        "model": served.model,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": "required",
        **GREEDY,
    }
    whole = client.chat.completions.create(**kwargs)
    assert whole.choices[0].finish_reason == "tool_calls"
    calls = _validate_calls(whole.choices[0].message.tool_calls)
    with client.chat.completions.stream(**kwargs) as stream:
        for event in stream:
            if event.type == "content.delta" and event.delta:
                pytest.fail(f"tool-call markup leaked into content: {event.delta!r}")
        streamed = stream.get_final_completion()
    assert streamed.choices[0].finish_reason == "tool_calls"
    assert _validate_calls(streamed.choices[0].message.tool_calls) == calls
    assert streamed.choices[0].message.content == whole.choices[0].message.content


def test_parse_with_a_pydantic_model(served: SimpleNamespace) -> None:
    completion = served.client.chat.completions.parse(
        model=served.model, messages=ASK, response_format=Forecast, **GREEDY
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Forecast)


@pytest.mark.parametrize("schema", SCHEMAS)
def test_json_schema_output_validates(served: SimpleNamespace, schema: dict[str, Any]) -> None:
    completion = served.client.chat.completions.create(
        model=served.model,
        messages=ASK,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "out", "schema": schema, "strict": True},
        },
        **GREEDY,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content or ""), schema)


def test_logprobs_agree_with_the_engine(served: SimpleNamespace, reference: Any) -> None:
    from sluicegate.engine import SamplingParams

    prompt = "Tell me about rivers."
    completion = served.client.chat.completions.create(
        model=served.model,
        messages=[{"role": "user", "content": prompt}],
        logprobs=True,
        top_logprobs=3,
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    content = completion.choices[0].logprobs.content
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    (want,) = reference.llm.chat([[{"role": "user", "content": prompt}]], params)
    assert want.logprobs is not None and len(content) == len(want.logprobs) == 6
    for got, expected in zip(content, want.logprobs, strict=True):
        assert got.logprob == pytest.approx(expected.logprob, abs=1e-4)
        assert len(got.top_logprobs) == 3
        assert [t.logprob for t in got.top_logprobs] == pytest.approx(
            [lp for _, lp in expected.top], abs=1e-4
        )
        assert got.bytes is not None


def test_three_seeded_choices_are_reproducible(served: SimpleNamespace) -> None:
    kwargs: dict[str, Any] = {
        "model": served.model,
        "messages": ASK,
        "n": 3,
        "seed": 11,
        "temperature": 1.0,
        "max_tokens": 12,
        "extra_body": {"ignore_eos": True},
    }
    first = served.client.chat.completions.create(**kwargs)
    again = served.client.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in again.choices]
    assert first.usage is not None and first.usage.completion_tokens == 36
    streamed: dict[int, str] = {0: "", 1: "", 2: ""}
    for chunk in served.client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert [streamed[i] for i in range(3)] == texts


def test_streamed_logprobs_and_text_completions_logprobs(served: SimpleNamespace) -> None:
    client = served.client
    kwargs: dict[str, Any] = {
        "model": served.model,
        "messages": [{"role": "user", "content": "Count."}],
        "logprobs": True,
        "top_logprobs": 2,
        "max_tokens": 5,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    whole = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    streamed = [
        entry
        for chunk in client.chat.completions.create(stream=True, **kwargs)
        for choice in chunk.choices
        if choice.logprobs is not None
        for entry in choice.logprobs.content or []
    ]
    # Same tokens and alternatives; the float values may differ in the last digits (another
    # batch shape on the worker).
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in whole]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in whole], abs=1e-4)
    assert [[t.token for t in e.top_logprobs] for e in streamed] == [
        [t.token for t in e.top_logprobs] for e in whole
    ]

    text = client.completions.create(
        model=served.model,
        prompt="The river",
        logprobs=2,
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    ).choices[0]
    logprobs = text.logprobs
    assert logprobs is not None and len(logprobs.tokens or []) == 5
    offsets = logprobs.text_offset or []
    assert offsets == [sum(len(t) for t in (logprobs.tokens or [])[:i]) for i in range(5)]
    tops = logprobs.top_logprobs or []
    # Two alternatives each (fewer keys when two tokens read the same, e.g. both U+FFFD); greedy
    # picked the most likely one.
    assert len(tops) == 5 and all(1 <= len(top) <= 2 for top in tops)
    assert all(
        lp >= max(top.values()) - 1e-4
        for lp, top in zip(logprobs.token_logprobs or [], tops, strict=True)
    )

"""Tool calling in the engine: prompts rendered by the checkpoint's template with the tools and
earlier calls, calls parsed per family, and required / named calls forced by a grammar so that
even a random model returns arguments that validate."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from sluicegate.engine import LLM, AsyncEngine, SamplingParams
from sluicegate.engine.protocol import ChatMessage, Tool, ToolCall
from sluicegate.engine.serving.request_options import RequestOptions

WEATHER = Tool(
    name="get_weather",
    description="Current weather in a city",
    parameters={
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 6},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
)
TIME = Tool(
    name="get_time",
    parameters={
        "type": "object",
        "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"],
        "additionalProperties": False,
    },
)
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = SamplingParams(max_tokens=140, temperature=0)


@pytest.fixture(scope="module")
def qwen2(model_dirs: dict[str, Path]) -> LLM:
    return LLM(str(model_dirs["qwen2"]), num_kv_blocks=256)


def validate_call(call: ToolCall, tools: list[Tool]) -> None:
    (tool,) = [t for t in tools if t.name == call.name]
    assert call.id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), tool.parameters or {})


def test_prompt_renders_tools_and_earlier_calls_through_the_template(qwen2: LLM) -> None:
    history = [
        ChatMessage(role="user", content="Weather in Paris?"),
        ChatMessage(
            role="assistant",
            tool_calls=[ToolCall("call_1", "get_weather", '{"city": "Paris", "unit": "celsius"}')],
        ),
        ChatMessage(role="tool", content='{"temp": 21}', tool_call_id="call_1"),
    ]
    ids = qwen2.engine.prompt_ids(messages=history, options=RequestOptions(tools=[WEATHER]))
    expected = qwen2.tokenizer.hf.apply_chat_template(
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": {"city": "Paris", "unit": "celsius"},
                        },
                    }
                ],
            },
            {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"},
        ],
        tools=[
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": WEATHER.description,
                    "parameters": WEATHER.parameters,
                },
            }
        ],
        add_generation_prompt=True,
        tokenize=False,
    )
    text = qwen2.tokenizer.hf.decode(ids)
    assert text == expected
    assert '"name": "get_weather"' in text and "<tool_response>" in text
    none = qwen2.engine.prompt_ids(
        messages=history, options=RequestOptions(tools=[WEATHER], tool_choice="none")
    )
    assert "# Tools" not in qwen2.tokenizer.hf.decode(none)


@pytest.mark.parametrize("seed", [None, 1, 2, 3])
def test_named_function_call_validates_against_its_schema(qwen2: LLM, seed: int | None) -> None:
    params = GREEDY if seed is None else SamplingParams(max_tokens=140, temperature=1.0, seed=seed)
    options = RequestOptions(
        tools=[WEATHER, TIME], tool_choice="function", tool_choice_name="get_weather"
    )
    (out,) = qwen2.chat(MESSAGES, params, options)
    assert out.finish_reason == "tool_calls", out
    assert out.text == "" and [c.name for c in out.tool_calls] == ["get_weather"]
    validate_call(out.tool_calls[0], [WEATHER])


@pytest.mark.parametrize("seed", [4, 5, 6])
def test_required_returns_a_call_to_one_of_the_tools(qwen2: LLM, seed: int) -> None:
    options = RequestOptions(tools=[WEATHER, TIME], tool_choice="required")
    params = SamplingParams(max_tokens=140, temperature=1.0, seed=seed)
    (out,) = qwen2.chat(MESSAGES, params, options)
    assert out.finish_reason == "tool_calls"
    assert len(out.tool_calls) == 1
    validate_call(out.tool_calls[0], [WEATHER, TIME])


def test_follow_up_turn_with_the_tool_result_is_served(qwen2: LLM) -> None:
    options = RequestOptions(tools=[WEATHER], tool_choice="required")
    (first,) = qwen2.chat(MESSAGES, GREEDY, options)
    call = first.tool_calls[0]
    follow_up = [
        *MESSAGES,
        {
            "role": "assistant",
            "tool_calls": [{"id": call.id, "name": call.name, "arguments": call.arguments}],
        },
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    (second,) = qwen2.chat(
        follow_up, SamplingParams(max_tokens=8, temperature=0), RequestOptions(tools=[WEATHER])
    )
    assert second.finish_reason in ("stop", "length", "tool_calls")
    prompt = qwen2.tokenizer.hf.decode(second.prompt_token_ids)
    assert f'"arguments": {json.dumps(json.loads(call.arguments))}' in prompt
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in prompt


async def test_streamed_calls_assemble_to_the_offline_result(model_dirs: dict[str, Path]) -> None:
    options = RequestOptions(tools=[WEATHER, TIME], tool_choice="required")
    (offline,) = LLM(str(model_dirs["qwen2"]), num_kv_blocks=256).chat(MESSAGES, GREEDY, options)
    async with AsyncEngine(model_dirs["qwen2"], num_kv_blocks=256) as engine:
        deltas = [
            d
            async for d in engine.add_request(
                "t1", messages=MESSAGES, params=GREEDY, options=options
            )
        ]
    assert all(d.text == "" for d in deltas)
    fragments = [f for d in deltas for f in d.tool_calls]
    assert fragments[0].id is not None and fragments[0].name == offline.tool_calls[0].name
    assert sum(1 for f in fragments if f.arguments) > 1, "arguments arrive in pieces"
    assert "".join(f.arguments for f in fragments) == offline.tool_calls[0].arguments
    assert deltas[-1].finish_reason == "tool_calls" and deltas[-1].done


def test_llama3_json_format_by_override(model_dirs: dict[str, Path]) -> None:
    llm = LLM(str(model_dirs["llama"]), num_kv_blocks=256, tool_parser="llama3_json")
    options = RequestOptions(tools=[TIME], tool_choice="function", tool_choice_name="get_time")
    (out,) = llm.chat(MESSAGES, GREEDY, options)
    assert out.finish_reason == "tool_calls"
    assert out.text == ""
    validate_call(out.tool_calls[0], [TIME])


def test_tool_requests_a_model_cannot_honour_are_rejected(
    qwen2: LLM, model_dirs: dict[str, Path]
) -> None:
    with pytest.raises(ValueError, match="not in tools"):
        RequestOptions(tools=[WEATHER], tool_choice="function", tool_choice_name="nope")
    with pytest.raises(ValueError, match="needs tools"):
        RequestOptions(tool_choice="required")
    with pytest.raises(ValueError, match="unknown tool parser"):
        LLM(str(model_dirs["qwen2"]), num_kv_blocks=16, tool_parser="nope")
    qwen2.engine.tool_parser, saved = None, qwen2.engine.tool_parser
    try:
        with pytest.raises(ValueError, match="--tool-parser"):
            qwen2.chat(MESSAGES, GREEDY, RequestOptions(tools=[WEATHER]))
    finally:
        qwen2.engine.tool_parser = saved


def test_auto_without_a_call_is_plain_content(qwen2: LLM) -> None:
    params = SamplingParams(max_tokens=12, temperature=0)
    (auto,) = qwen2.chat(MESSAGES, params, RequestOptions(tools=[WEATHER]))
    assert auto.tool_calls == [] and "<tool_call>" not in auto.text
    (unparsed,) = qwen2.generate(auto.prompt_token_ids, params)
    assert auto.text == unparsed.text
    assert auto.finish_reason in ("stop", "length")


def test_strict_tools_bind_calls_the_model_chooses_to_make(qwen2: LLM) -> None:
    """tool_choice auto with ``strict`` tools: text stays free, but once the model opens a
    call (here pushed to with logit_bias) the call must match the schema."""
    strict = Tool(name=TIME.name, parameters=TIME.parameters, strict=True)
    open_call = qwen2.tokenizer.hf.convert_tokens_to_ids("<tool_call>")
    params = SamplingParams(max_tokens=140, temperature=1.0, seed=3, logit_bias={open_call: 30})
    (out,) = qwen2.chat(MESSAGES, params, RequestOptions(tools=[strict]))
    # max_tokens may cut the last call short; every call before it is complete.
    complete = out.tool_calls[:-1] if out.finish_reason == "length" else out.tool_calls
    assert complete, out.tool_calls
    for call in complete:
        validate_call(call, [strict])
    assert out.text == ""


def test_strict_tools_with_a_response_format_give_a_valid_answer_or_a_valid_call(
    qwen2: LLM,
) -> None:
    from sluicegate.engine.protocol import Structured

    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    strict = Tool(name=TIME.name, parameters=TIME.parameters, strict=True)
    structured = Structured("json_schema", json_schema=json.dumps(schema))
    options = RequestOptions(tools=[strict], structured=structured)
    # Nudge the first token: "{" opens the answer, "<tool_call>" a call.
    kinds = set()
    for first in ("{", "<tool_call>"):
        nudge = {qwen2.tokenizer.hf.convert_tokens_to_ids(first): 100.0}
        params = SamplingParams(max_tokens=140, temperature=0, logit_bias=nudge)
        (out,) = qwen2.chat(MESSAGES, params, options)
        if out.finish_reason == "tool_calls":
            assert out.text == ""
            validate_call(out.tool_calls[0], [strict])
        else:
            assert out.finish_reason == "stop" and not out.tool_calls
            jsonschema.validate(json.loads(out.text), schema)
        kinds.add(out.finish_reason)
    assert kinds == {"stop", "tool_calls"}

    forced = RequestOptions(tools=[TIME], tool_choice="required", structured=structured)
    (out,) = qwen2.chat(MESSAGES, GREEDY, forced)
    assert out.finish_reason == "tool_calls", "a forced call wins over the answer format"
    validate_call(out.tool_calls[0], [TIME])

"""``/v1/embeddings`` through the lifecycle; fields an engine cannot honour are 400s naming them;
and an OpenAI body's translation onto the engine's wire (protocol v3)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import msgspec
import openai
import pytest

from sluicegate.engine import protocol
from sluicegate.gateway.providers.engine.wire import wire_request
from sluicegate.gateway.schemas.chat import ChatCompletionRequest

from .servers import Upstream

HELLO = [{"role": "user", "content": "hello world"}]


def sdk(gateway: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0)


def test_embeddings_are_routed_limited_and_billed(
    gateway: str,
    make_key: Callable[..., str],
    upstream: tuple[Upstream, str],
    usage_events: Callable[..., list],
) -> None:
    client = sdk(gateway, make_key(tpm_limit=1000))
    raw = client.embeddings.with_raw_response.create(
        model="embed", input=["one two", "three"], dimensions=2
    )
    result = raw.parse()
    assert result.model == "embed"
    assert [item.embedding for item in result.data] == [[0.0, 7.0], [1.0, 5.0]]
    assert result.usage.prompt_tokens == 3
    sent = upstream[0].last_body("embed-up")
    assert sent == {
        "model": "embed-up",
        "input": ["one two", "three"],
        "dimensions": 2,
        "encoding_format": "base64",
    } or sent == {"model": "embed-up", "input": ["one two", "three"], "dimensions": 2}
    assert raw.headers["x-ratelimit-limit-tokens"] == "1000"
    (event,) = usage_events(raw.headers["x-request-id"])
    assert (event.model, event.status, event.prompt_tokens, event.completion_tokens) == (
        "embed",
        "ok",
        3,
        0,
    )


def test_a_model_without_an_embeddings_deployment_is_a_404(
    gateway: str, make_key: Callable[..., str]
) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        sdk(gateway, make_key()).embeddings.create(model="echo", input="hi")
    assert caught.value.code == "model_not_found"
    assert "embeddings" in caught.value.message
    with pytest.raises(openai.NotFoundError) as chat:
        sdk(gateway, make_key()).chat.completions.create(model="embed", messages=HELLO)
    assert chat.value.code == "model_not_found"


IMAGE_PART = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {
                "messages": [
                    HELLO[0],
                    {"role": "user", "content": [{"type": "text", "text": "x"}, IMAGE_PART]},
                ]
            },
            "messages[1].content[1]",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "input_audio",
                                "input_audio": {"data": "AA==", "format": "wav"},
                            }
                        ],
                    }
                ]
            },
            "messages[0].content[0]",
        ),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"verbosity": "low"}, "verbosity"),
        ({"store": True}, "store"),
        ({"service_tier": "priority"}, "service_tier"),
        ({"best_of": 3}, "best_of"),
        ({"functions": [{"name": "f"}]}, "functions"),
        (
            {
                "messages": [
                    {"role": "user", "content": "x", "cache_control": {"type": "ephemeral"}}
                ]
            },
            "messages[0].cache_control",
        ),
        # Unknown keys inside known objects are fields too: named, not dropped.
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}
                        ],
                    }
                ]
            },
            "messages[0].content[0].cache_control",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "examples": [{}]}}]},
            "tools[0].function.examples",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": {}, "schema_version": 2},
                }
            },
            "response_format.json_schema.schema_version",
        ),
        (
            {"stream": True, "stream_options": {"continuous_usage_stats": True}},
            "stream_options.continuous_usage_stats",
        ),
        (
            {"tool_choice": {"type": "function", "function": {"name": "f", "why": "x"}}},
            "tool_choice.function.why",
        ),
    ],
)
def test_what_an_engine_cannot_honour_is_a_400_naming_it(
    gateway: str, make_key: Callable[..., str], extra: dict[str, Any], param: str
) -> None:
    body = {"model": "engine-only", "messages": HELLO, **extra}
    if "tool_choice" in extra:
        body["tools"] = [{"type": "function", "function": {"name": "f"}}]
    response = httpx.post(
        f"{gateway}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {make_key()}"},
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)


def test_vllm_extras_and_identifying_fields_are_accepted_for_engines(
    gateway: str, make_key: Callable[..., str]
) -> None:
    echoed = {  # an SDK's response message sent back as history: unset fields are null
        "role": "assistant",
        "content": None,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    }
    body = {
        "model": "engine-only",
        "messages": [*HELLO, echoed, {"role": "tool", "tool_call_id": "call_1", "content": "1"}],
        "functions": None,
        "top_k": 5,
        "min_p": 0.1,
        "repetition_penalty": 1.1,
        "ignore_eos": True,
        "stop_token_ids": [2],
        "guided_choice": ["yes", "no"],
        "chat_template_kwargs": {"enable_thinking": False},
        "user": "u",
        "safety_identifier": "s",
        "metadata": {"a": "b"},
        "prompt_cache_key": "k",
        "service_tier": "auto",
        "store": False,
    }
    response = httpx.post(
        f"{gateway}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {make_key()}"},
    )
    # Admitted and routed: the pool simply has no worker.
    assert response.status_code == 503, response.text


def test_parse_answers_sent_back_as_history_are_accepted_for_engines(
    gateway: str, make_key: Callable[..., str]
) -> None:
    """What the openai SDK (3.x) sends when a ``parse()`` answer goes back into ``messages``:
    its ``parsed`` and ``parsed_arguments`` repeat the content and the arguments already there,
    so they are no field an engine would drop."""
    parsed_answer = {"content": '{"city":"P"}', "role": "assistant", "parsed": {"city": "P"}}
    parsed_call = {
        "content": None,
        "role": "assistant",
        "parsed": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {
                    "name": "W",
                    "arguments": '{"city":"P"}',
                    "parsed_arguments": {"city": "P"},
                },
            }
        ],
    }
    body = {
        "model": "engine-only",
        "messages": [
            *HELLO,
            parsed_answer,
            *HELLO,
            parsed_call,
            {"role": "tool", "tool_call_id": "call_1", "content": "1"},
        ],
    }
    response = httpx.post(
        f"{gateway}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {make_key()}"},
    )
    assert response.status_code == 503, response.text  # admitted: the pool has no worker


def test_a_model_with_an_engine_and_an_openai_deployment_sends_images_to_the_one_that_can(
    gateway: str, make_key: Callable[..., str], upstream: tuple[Upstream, str]
) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "what?"}, IMAGE_PART]}]
    completion = sdk(gateway, make_key()).chat.completions.create(
        model="mixed",
        messages=messages,  # type: ignore[arg-type]
    )
    assert completion.choices[0].message.content
    assert upstream[0].last_body("echo")["messages"] == messages


def _wire(body: dict[str, Any]) -> protocol.Request:
    document = msgspec.json.decode(msgspec.json.encode(body))
    request = msgspec.convert(document, ChatCompletionRequest)
    request.check()
    canonical = request.canonical(document)
    canonical.request_id = "r1"
    wire = wire_request(canonical, "m", 0.0, "sg:reply:{x}", default_max_tokens=99)
    # What travels is what the worker reads back.
    decoded = protocol.decode(protocol.encode(wire))
    assert isinstance(decoded, protocol.Request)
    return decoded


def test_an_openai_body_on_the_engine_wire() -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                "strict": True,
            },
        }
    ]
    wire = _wire(
        {
            "model": "engine-only",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Weather "},
                        {"type": "text", "text": "in Paris?"},
                    ],
                },
                {
                    "role": "assistant",
                    "content": None,
                    "reasoning_content": "Need the tool.",
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "21C"},
            ],
            "tools": tools,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "parallel_tool_calls": False,
            "n": 3,
            "seed": 7,
            "logprobs": True,
            "top_logprobs": 4,
            "logit_bias": {"17": -5.5},
            "stop": "END",
            "max_completion_tokens": 20,
            "reasoning_effort": "minimal",
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "w", "schema": {"type": "object"}, "strict": True},
            },
        }
    )
    assert [m.role for m in wire.messages or []] == ["system", "user", "assistant", "tool"]
    user, assistant, tool = (wire.messages or [])[1:]
    assert user.content == "Weather in Paris?"
    assert assistant.tool_calls == [protocol.ToolCall("call_1", "get_weather", '{"city":"Paris"}')]
    assert assistant.reasoning_content == "Need the tool."
    assert (tool.content, tool.tool_call_id) == ("21C", "call_1")
    assert wire.tools == [
        protocol.Tool(
            "get_weather",
            "Weather",
            {"type": "object", "properties": {"city": {"type": "string"}}},
            strict=True,
        )
    ]
    assert (wire.tool_choice, wire.tool_choice_name) == ("function", "get_weather")
    assert wire.parallel_tool_calls is False
    assert wire.n == 3
    s = wire.sampling
    assert (s.seed, s.logprobs, s.logit_bias, s.stop, s.max_tokens) == (
        7,
        4,
        {17: -5.5},
        ["END"],
        20,
    )
    assert wire.structured is not None
    assert (wire.structured.kind, wire.structured.strict) == ("json_schema", True)
    assert msgspec.json.decode(wire.structured.json_schema or "") == {"type": "object"}
    assert wire.chat_template_kwargs == {"enable_thinking": False}


@pytest.mark.parametrize(
    ("fields", "kind", "attribute", "value"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object", "kind", "json_object"),
        ({"guided_regex": "[a-z]+"}, "regex", "regex", "[a-z]+"),
        ({"guided_choice": ["a", "b"]}, "choice", "choices", ["a", "b"]),
        ({"guided_grammar": 'root ::= "x"'}, "grammar", "grammar", 'root ::= "x"'),
        ({"guided_json": {"type": "string"}}, "json_schema", "json_schema", '{"type":"string"}'),
    ],
)
def test_output_constraints_on_the_engine_wire(
    fields: dict[str, Any], kind: str, attribute: str, value: Any
) -> None:
    wire = _wire({"model": "m", "messages": HELLO, **fields})
    assert wire.structured is not None
    assert wire.structured.kind == kind
    assert getattr(wire.structured, attribute) == value
    assert wire.sampling.max_tokens == 99, "the engine's default cap applies when none was sent"


def test_plain_requests_carry_no_constraint_tools_or_logprobs() -> None:
    wire = _wire({"model": "m", "messages": HELLO})
    assert (wire.structured, wire.tools, wire.sampling.logprobs, wire.chat_template_kwargs) == (
        None,
        None,
        None,
        None,
    )
    assert (wire.tool_choice, wire.n) == ("auto", 1)
    thinking = _wire({"model": "m", "messages": HELLO, "reasoning_effort": "high"})
    assert thinking.chat_template_kwargs == {"enable_thinking": True}


def test_thinking_display_is_a_400_for_engines(gateway: str, make_key: Callable[..., str]) -> None:
    # An engine returns the checkpoint's thinking as written: never summarized, never left out.
    body = {
        "model": "engine-only",
        "max_tokens": 5,
        "messages": HELLO,
        "thinking": {"type": "enabled", "budget_tokens": 1024, "display": "summarized"},
    }
    response = httpx.post(f"{gateway}/v1/messages", json=body, headers={"x-api-key": make_key()})
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert "thinking.display" in error["error"]["message"]
    del body["thinking"]["display"]  # type: ignore[attr-defined]
    response = httpx.post(f"{gateway}/v1/messages", json=body, headers={"x-api-key": make_key()})
    assert response.status_code == 529, response.text  # admitted: the pool has no worker

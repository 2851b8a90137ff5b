"""Each hosted-API adapter against a real server speaking that API's wire format: whole and
streamed answers, tools, finish reasons, usage, errors and unsupported fields."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sluicegate.gateway.call.response_builder import ResponseBuilder
from sluicegate.gateway.canonical import (
    ChatRequest,
    Chunk,
    Message,
    OutputFormat,
    ReasoningPiece,
    Sampling,
    TextPart,
    Thinking,
    Tool,
    ToolCall,
    ToolChoice,
    ToolResult,
    text_message,
)
from sluicegate.gateway.providers.base import ProviderError
from sluicegate.gateway.providers.hosted import Sessions
from sluicegate.gateway.providers.openai import OpenAIProvider

from ..api.servers import ServerThread, Upstream
from . import fake_anthropic
from .conftest import KINDS, ProviderFactory
from .fake_common import TOOL_ARGUMENTS

WEATHER = Tool(
    "get_weather",
    "The weather in a city",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)


def chat(*messages: Message, **fields: Any) -> ChatRequest:
    return ChatRequest(model="m", messages=list(messages), **fields)


async def streamed(provider: Any, request: ChatRequest) -> tuple[list[Chunk], Any]:
    chunks = [chunk async for chunk in provider.generate(request)]
    builder = ResponseBuilder()
    for chunk in chunks:
        builder.add(chunk)
    return chunks, builder.build()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_text_answer_finish_and_usage(
    make_provider: ProviderFactory, kind: str, stream: bool
) -> None:
    provider = make_provider(kind, "plain")
    request = chat(
        text_message("system", "be brief"),
        text_message("user", "say some words"),
        sampling=Sampling(max_tokens=3),
    )
    assert provider.unsupported(request) is None
    if stream:
        chunks, answer = await streamed(provider, request)
        assert sum(1 for c in chunks if c.has_output()) == 3
    else:
        answer = await provider.complete(request)
    assert answer.text() == "w0 w1 w2 "
    assert answer.finish_reason() == "length"
    usage = answer.usage
    assert usage is not None and usage.completion_tokens == 3
    # Prompt words: "be brief" + "say some words"; Anthropic and Bedrock add cached tokens.
    cached = {"anthropic": 3, "bedrock": 2}.get(kind, 0)
    assert usage.prompt_tokens == 5 + cached
    assert usage.cached_tokens == {"anthropic": 2, "bedrock": 2}.get(kind, 0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_forced_tool_call_and_result_turn(
    make_provider: ProviderFactory, kind: str, stream: bool
) -> None:
    provider = make_provider(kind, "tools")
    request = chat(
        text_message("user", "hello"),
        tools=[WEATHER],
        tool_choice=ToolChoice("function", "get_weather"),
    )
    answer = (await streamed(provider, request))[1] if stream else await provider.complete(request)
    assert answer.finish_reason() == "tool_calls"
    calls = answer.choices[0].message.tool_calls()
    assert [c.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].arguments) == TOOL_ARGUMENTS
    assert calls[0].id
    # The follow-up turn carries the call and its result back in the backend's own shape.
    follow = chat(
        text_message("user", "hello"),
        Message("assistant", [ToolCall(calls[0].id, "get_weather", calls[0].arguments)]),
        Message("tool", [ToolResult(calls[0].id, [TextPart("sunny and warm")])]),
        tools=[WEATHER],
    )
    answer = await provider.complete(follow)
    assert answer.finish_reason() == "stop" and answer.text().startswith("w0")


@pytest.mark.parametrize("kind", ["anthropic", "bedrock"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_claude_thinking_comes_block_by_block_and_goes_back(
    make_provider: ProviderFactory, kind: str, stream: bool
) -> None:
    """Several thinking blocks in one answer, whole or folded from the stream: each keeps its
    signature and place, and they all go back in the next turn (the fakes check it)."""
    provider = make_provider(kind, "interleaved")
    think = Thinking("enabled", 1024)
    ask = text_message("user", "what is the weather in Paris")
    request = chat(ask, tools=[WEATHER], thinking=think)
    answer = (await streamed(provider, request))[1] if stream else await provider.complete(request)
    message = answer.choices[0].message
    issued = fake_anthropic.INTERLEAVED
    assert message.reasoning_pieces == [
        ReasoningPiece(issued[0]["thinking"], issued[0]["signature"], at=0),
        ReasoningPiece(redacted=issued[1]["data"], at=0),
        ReasoningPiece(issued[3]["thinking"], issued[3]["signature"], at=1),
    ]
    assert message.reasoning == issued[0]["thinking"] + issued[3]["thinking"]
    call = message.tool_calls()[0]
    result = Message("tool", [ToolResult(call.id, [TextPart("sunny")])])
    follow = await provider.complete(chat(ask, message, result, tools=[WEATHER], thinking=think))
    assert follow.finish_reason() == "stop"
    message.reasoning_pieces = message.reasoning_pieces[:1]
    with pytest.raises(ProviderError) as refused:
        await provider.complete(chat(ask, message, result, tools=[WEATHER], thinking=think))
    assert refused.value.status_code == 400


@pytest.mark.parametrize("kind", ["anthropic", "bedrock"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_stop_sequence_reported(
    make_provider: ProviderFactory, kind: str, stream: bool
) -> None:
    provider = make_provider(kind, "plain")
    request = chat(text_message("user", "go"), sampling=Sampling(max_tokens=50, stop=["w2"]))
    answer = (await streamed(provider, request))[1] if stream else await provider.complete(request)
    assert answer.text() == "w0 w1 "
    assert answer.finish_reason() == "stop"
    if kind == "anthropic":
        assert answer.choices[0].stop_sequence == "w2"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_rate_limit_is_retryable_with_retry_after(
    make_provider: ProviderFactory, kind: str, stream: bool
) -> None:
    provider = make_provider(kind, "limited")
    request = chat(text_message("user", "hi"))
    with pytest.raises(ProviderError) as caught:
        if stream:
            await streamed(provider, request)
        else:
            await provider.complete(request)
    assert caught.value.retryable and caught.value.status_code == 429
    if kind != "bedrock":
        assert caught.value.retry_after_s == 0


@pytest.mark.parametrize("kind", KINDS)
async def test_errors_map_without_leaking_address_or_key(
    make_provider: ProviderFactory, fakes: dict[str, Any], kind: str
) -> None:
    request = chat(text_message("user", "hi"))
    with pytest.raises(ProviderError) as down:
        await make_provider(kind, "down").complete(request)
    assert down.value.retryable and down.value.status_code == 502
    with pytest.raises(ProviderError) as bad:
        await make_provider(kind, "bad").complete(request)
    assert not bad.value.retryable and bad.value.status_code == 400
    wrong = {"api_key": "wrong-key", "secret": "wrong-secret"}
    with pytest.raises(ProviderError) as refused:
        await make_provider(kind, "plain", **wrong).complete(request)
    assert refused.value.retryable, "a misconfigured deployment lets the router fall back"
    for error in (down.value, bad.value, refused.value):
        text = str(error)
        assert "127.0.0.1" not in text and "wrong-" not in text and "test-key" not in text


@pytest.mark.parametrize("kind", KINDS)
async def test_unsupported_field_names_it(make_provider: ProviderFactory, kind: str) -> None:
    provider = make_provider(kind, "plain")
    request = chat(text_message("user", "hi"), sampling=Sampling(logit_bias={5: 1.0}))
    problem = provider.unsupported(request)
    if kind.startswith("azure"):
        assert problem is None  # Azure speaks OpenAI's API: the field is forwarded
        return
    assert problem is not None and problem.status_code == 400 and problem.param == "logit_bias"


async def test_gemini_json_schema_and_candidates(
    make_provider: ProviderFactory, fakes: dict[str, Any]
) -> None:
    provider = make_provider("gemini", "plain")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    request = chat(
        text_message("user", "hi"),
        sampling=Sampling(max_tokens=2, n=2),
        output=OutputFormat("json_schema", schema=schema),
    )
    answer = await provider.complete(request)
    assert [c.index for c in answer.choices] == [0, 1]
    config = fakes["gemini"][0].bodies[-1]["generationConfig"]
    assert config["responseMimeType"] == "application/json"
    assert config["responseJsonSchema"] == schema and config["candidateCount"] == 2


async def test_bedrock_rejects_a_changed_body(make_provider: ProviderFactory) -> None:
    """The fake verifies SigV4 for real: a signature over other bytes is refused."""
    provider = make_provider("bedrock", "plain", secret="not-the-secret")
    with pytest.raises(ProviderError) as caught:
        await provider.complete(chat(text_message("user", "hi")))
    assert "refused" in str(caught.value)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fault", ["cut-0", "cut-5", "garble-1", "garble-5"])
async def test_a_broken_stream_may_be_retried_only_before_output(
    make_provider: ProviderFactory, kind: str, fault: str
) -> None:
    """Once text reached the client another deployment must not start over."""
    provider = make_provider(kind, fault)
    chunks: list[Chunk] = []
    with pytest.raises(ProviderError) as caught:
        async for chunk in provider.generate(chat(text_message("user", "say some words"))):
            chunks.append(chunk)
    started = any(chunk.has_output() for chunk in chunks)
    assert started == fault.endswith("-5")
    assert caught.value.retryable == (not started)
    broken = "ended the stream early" if fault.startswith("cut") else "sent an unreadable"
    assert broken in str(caught.value)


@pytest.mark.parametrize("kind", KINDS)
async def test_an_unreadable_whole_answer_is_retryable(
    make_provider: ProviderFactory, kind: str
) -> None:
    with pytest.raises(ProviderError) as caught:
        await make_provider(kind, "garble-1").complete(chat(text_message("user", "hi")))
    assert caught.value.retryable and "sent an unreadable answer" in str(caught.value)


@pytest.mark.parametrize("kind", ["anthropic", "gemini", "azure", "azure-v1"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
async def test_only_azure_passes_the_traceparent_on(
    make_provider: ProviderFactory, fakes: dict[str, Any], kind: str, stream: bool
) -> None:
    """The fakes refuse a call without their key header; Azure, like OpenAI, joins the trace."""
    trace = f"00-{'1' * 32}-{'2' * 16}-01"
    provider = make_provider(kind, "plain")
    request = chat(text_message("user", "hi"), traceparent=trace)
    await (streamed(provider, request) if stream else provider.complete(request))
    sent = fakes[kind.split("-")[0]][0].headers[-1]
    assert sent["content-type"] == "application/json"
    assert sent.get("traceparent") == (trace if kind.startswith("azure") else None)


async def test_a_turn_of_two_tool_results_reaches_openai_compatible_upstreams(
    make_provider: ProviderFactory, fakes: dict[str, Any]
) -> None:
    """Anthropic's API answers parallel calls in one turn; OpenAI's wants a message each."""
    request = chat(
        text_message("user", "weather in two cities?"),
        Message(
            "assistant", [ToolCall("a", "get_weather", "{}"), ToolCall("b", "get_weather", "{}")]
        ),
        Message(
            "tool", [ToolResult("a", [TextPart("sunny")]), ToolResult("b", [TextPart("rain")])]
        ),
    )
    expected = [
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "b", "content": "rain"},
    ]
    await make_provider("azure", "plain").complete(request)
    assert fakes["azure"][0].bodies[-1]["messages"][2:] == expected

    upstream = Upstream()
    server = ServerThread(upstream).start()
    sessions = Sessions()
    provider = OpenAIProvider(
        name="openai:m", base_url=f"{server.url}/v1", model="m", sessions=sessions
    )
    try:
        answer = await provider.complete(request)
        assert answer.text()
        sent = upstream.last_body("m")["messages"]
        assert sent[1]["content"] is None and len(sent[1]["tool_calls"]) == 2
        assert sent[2:] == expected
    finally:
        await provider.close()
        await sessions.close()
        server.stop()

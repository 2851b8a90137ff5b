"""A server-sent event is one line, and Gemini sends a function call whole in one event: a
long one (megabytes of arguments) streams through; one past the gateway's line limit is a
clear ``ProviderError``, retryable only while nothing reached the client."""

from __future__ import annotations

import json
from typing import Any

import pytest

from sluicegate.gateway.canonical import (
    ChatRequest,
    Chunk,
    Thinking,
    Tool,
    ToolChoice,
    text_message,
)
from sluicegate.gateway.providers.base import ProviderError
from sluicegate.gateway.providers.hosted import SSE_MAX_LINE_BYTES

from .conftest import ProviderFactory

WRITE = Tool("write_file", "Writes a file", {"type": "object"})
MIB = 1024 * 1024


def _call(**fields: Any) -> ChatRequest:
    return ChatRequest(
        model="m",
        messages=[text_message("user", "write it")],
        tools=[WRITE],
        tool_choice=ToolChoice("function", "write_file"),
        **fields,
    )


async def test_a_megabytes_long_function_call_streams_through(
    make_provider: ProviderFactory,
) -> None:
    kib = 3 * 1024
    chunks = [c async for c in make_provider("gemini", f"bigcall-{kib}").generate(_call())]
    calls = [call for c in chunks for d in c.choices for call in d.tool_calls or ()]
    assert len(calls) == 1 and calls[0].name == "write_file"
    assert len(json.loads(calls[0].arguments)["city"]) == kib * 1024
    assert chunks[-1].finish_reason() == "tool_calls"


@pytest.mark.parametrize("thinking", [False, True], ids=["first", "after-output"])
async def test_a_line_past_the_limit_is_a_clear_error(
    make_provider: ProviderFactory, thinking: bool
) -> None:
    model = f"bigcall-{SSE_MAX_LINE_BYTES // 1024 + 64}"
    request = _call(thinking=Thinking("enabled", 1024) if thinking else None)
    chunks: list[Chunk] = []
    with pytest.raises(ProviderError) as caught:
        async for chunk in make_provider("gemini", model).generate(request):
            chunks.append(chunk)
    assert f"sent a line longer than {SSE_MAX_LINE_BYTES // MIB} MiB" in str(caught.value)
    # The thought part reached the client first: another deployment must not start over.
    assert any(c.has_output() for c in chunks) == thinking
    assert caught.value.retryable == (not thinking)

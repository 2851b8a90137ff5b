"""A stream that would run on past its request's deadline is ended there, with an error the
client sees: past it the request's concurrency slot and reservation are no longer held for it.
Real upstreams that never stop dripping tokens (each read well inside the read timeout)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

from sluicegate.gateway.canonical import ChatRequest, Message, TextPart
from sluicegate.gateway.providers.anthropic import AnthropicProvider
from sluicegate.gateway.providers.base import ProviderError
from sluicegate.gateway.providers.hosted import Sessions
from sluicegate.gateway.providers.openai import OpenAIProvider
from tests.gateway.api.servers import ServerThread, read_body, serve_lifespan

from .fake_common import send_bytes, sse, start_stream

DRIP_S = 0.02


class Drip:
    """An upstream that answers every stream with a token every ``DRIP_S``, in the
    OpenAI or the Anthropic shape (by path), for far longer than the tests' deadlines."""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await serve_lifespan(receive, send)
            return
        await read_body(receive)
        await start_stream(send)
        anthropic = scope["path"].endswith("/messages")
        if anthropic:
            start = {"id": "msg_drip", "type": "message", "role": "assistant", "model": "m",
                     "content": [], "usage": {"input_tokens": 3, "output_tokens": 1}}  # fmt: skip
            await send_bytes(
                send, sse({"type": "message_start", "message": start}, "message_start")
            )
            block = {"type": "content_block_start", "index": 0,
                     "content_block": {"type": "text", "text": ""}}  # fmt: skip
            await send_bytes(send, sse(block, "content_block_start"))
        for _ in range(int(3 / DRIP_S)):  # far past any deadline the tests set
            if anthropic:
                delta = {"type": "content_block_delta", "index": 0,
                         "delta": {"type": "text_delta", "text": "a "}}  # fmt: skip
                await send_bytes(send, sse(delta, "content_block_delta"))
            else:
                chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
                         "choices": [{"index": 0, "delta": {"content": "a "}}]}  # fmt: skip
                await send_bytes(send, sse(chunk))
            await asyncio.sleep(DRIP_S)
        await send_bytes(send, b"", more=False)


@pytest.fixture(scope="module")
def drip_url() -> Iterator[str]:
    server = ServerThread(Drip()).start()
    yield server.url
    server.stop()


def request(deadline: float) -> ChatRequest:
    body = ChatRequest(model="m", messages=[Message("user", [TextPart("go")])], stream=True)
    body.sampling.max_tokens = 100_000
    body.deadline = deadline
    return body


async def drain(provider: Any, deadline: float) -> tuple[int, ProviderError | None]:
    chunks = 0
    try:
        async for chunk in provider.generate(request(deadline)):
            chunks += chunk.has_output()
    except ProviderError as exc:
        return chunks, exc
    return chunks, None


async def test_an_openai_compatible_stream_ends_at_the_deadline(drip_url: str) -> None:
    sessions = Sessions()
    try:
        provider = OpenAIProvider(
            name="drip",
            base_url=drip_url + "/v1",
            model="m",
            sessions=sessions,
            read_timeout_s=5,
            first_token_timeout_s=5,
        )
        started = time.monotonic()
        chunks, error = await asyncio.wait_for(drain(provider, time.time() + 0.5), 10)
    finally:
        await sessions.close()
    assert error is not None and error.status_code == 504
    assert not error.retryable  # the client already had output
    assert chunks > 0
    assert time.monotonic() - started < 2


async def test_a_hosted_stream_ends_at_the_deadline(drip_url: str) -> None:
    sessions = Sessions()
    try:
        provider = AnthropicProvider(
            name="drip", model="m", sessions=sessions, api_key="k", base_url=drip_url
        )
        started = time.monotonic()
        chunks, error = await asyncio.wait_for(drain(provider, time.time() + 0.5), 10)
    finally:
        await sessions.close()
    assert error is not None and not error.retryable
    assert chunks > 0
    assert time.monotonic() - started < 2

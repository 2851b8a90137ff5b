"""Streams to an OpenAI-compatible upstream do not queue behind each other: the router's
session has no connection cap (httpx's pool held the 1,001st stream until an earlier one
ended), and a deployment caps its own only when the routing file says ``max_connections``."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from redis.asyncio import Redis

from sluicegate.gateway.canonical import ChatRequest, Message, TextPart
from sluicegate.gateway.providers.hosted import Sessions
from sluicegate.gateway.providers.openai import OpenAIProvider
from sluicegate.gateway.routing.config import ConfigError
from sluicegate.gateway.routing.router import Router
from sluicegate.gateway.settings import Settings
from tests.gateway.api.servers import ServerThread, read_body, serve_lifespan

from .fake_common import send_bytes, sse, start_stream

PAST_THE_OLD_CAP = 1100


class Gate:
    """Each stream sends one token, then holds until ``release``; ``open`` counts the streams
    holding at once, and its peak."""

    def __init__(self) -> None:
        self.open = 0
        self.peak = 0
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._released: asyncio.Event | None = None

    def release(self) -> None:
        """From the test's thread: the upstream's streams run on the server's loop."""
        if self._loop is not None and self._released is not None:
            self._loop.call_soon_threadsafe(self._released.set)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await serve_lifespan(receive, send)
            return
        if self._released is None:
            self._loop, self._released = asyncio.get_running_loop(), asyncio.Event()
        await read_body(receive)
        await start_stream(send)
        chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
                 "choices": [{"index": 0, "delta": {"content": "a"}}]}  # fmt: skip
        await send_bytes(send, sse(chunk))
        with self._lock:
            self.open += 1
            self.peak = max(self.peak, self.open)
        await self._released.wait()
        with self._lock:
            self.open -= 1
        done = {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
        await send_bytes(send, sse(done) + b"data: [DONE]\n\n", more=False)


@pytest.fixture
def gate() -> Iterator[tuple[Gate, str]]:
    upstream = Gate()
    server = ServerThread(upstream).start()
    yield upstream, server.url
    upstream.release()
    server.stop()


def _request() -> ChatRequest:
    return ChatRequest(model="m", messages=[Message("user", [TextPart("go")])], stream=True)


async def _stream(provider: OpenAIProvider) -> int:
    return sum([chunk.has_output() async for chunk in provider.generate(_request())])


async def _open_streams(
    upstream: Gate, provider: OpenAIProvider, count: int, expect_open: int
) -> list[int]:
    streams = [asyncio.create_task(_stream(provider)) for _ in range(count)]
    try:
        async with asyncio.timeout(60):
            # The count lives on the upstream's thread, which no asyncio event here can hear.
            while upstream.open < expect_open:  # noqa: ASYNC110
                await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # room for any stream past the cap to show up
        assert upstream.peak == expect_open
        upstream.release()
        return await asyncio.gather(*streams)
    finally:
        for stream in streams:
            stream.cancel()


async def test_more_streams_than_the_old_pool_held_are_open_at_once(
    gate: tuple[Gate, str],
) -> None:
    upstream, url = gate
    sessions = Sessions()
    provider = OpenAIProvider(name="wide", base_url=url + "/v1", model="m", sessions=sessions)
    try:
        tokens = await _open_streams(upstream, provider, PAST_THE_OLD_CAP, PAST_THE_OLD_CAP)
    finally:
        await sessions.close()
    assert tokens == [1] * PAST_THE_OLD_CAP


async def test_a_deployment_caps_its_own_connections(gate: tuple[Gate, str]) -> None:
    upstream, url = gate
    sessions = Sessions()
    provider = OpenAIProvider(
        name="narrow", base_url=url + "/v1", model="m", sessions=sessions, max_connections=2
    )
    try:
        tokens = await _open_streams(upstream, provider, 5, 2)
    finally:
        await sessions.close()
    assert tokens == [1] * 5


def test_max_connections_comes_from_the_routing_file(redis_url: str) -> None:
    router = Router(Settings.from_env(redis_url=redis_url), Redis.from_url(redis_url), routes=[])
    spec = {"provider": "openai", "base_url": "http://127.0.0.1:9/v1", "model": "m"}
    capped = router.make_deployment({**spec, "max_connections": 3}).provider
    assert isinstance(capped, OpenAIProvider) and capped._slots is not None
    assert capped._slots._value == 3
    uncapped = router.make_deployment(spec).provider
    assert isinstance(uncapped, OpenAIProvider) and uncapped._slots is None
    for bad in (-1, "8", 2.5, True):
        with pytest.raises(ConfigError, match="max_connections"):
            router.make_deployment({**spec, "max_connections": bad})

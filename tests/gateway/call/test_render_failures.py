"""A renderer that fails (a whole answer's body, a stream's opening or closing) still leaves
the request settled: its concurrency slot free and its reservation corrected. Real upstream
(the OpenAI-compatible test server), real Redis; the renderer is the chat API's, made to fail
at one step."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from opentelemetry.trace import INVALID_SPAN
from redis.asyncio import Redis

from sluicegate.gateway.admission.limits import RateLimiter
from sluicegate.gateway.api.openai_chat import ChatRenderer
from sluicegate.gateway.call.call import Call
from sluicegate.gateway.call.stream import stream
from sluicegate.gateway.canonical import ChatRequest, Chunk, Message, TextPart
from sluicegate.gateway.canonical import Response as Answer
from sluicegate.gateway.routing.router import Router
from sluicegate.gateway.services import Services
from sluicegate.gateway.settings import Settings
from sluicegate.gateway.usage.stream import UsageRecorder
from tests.gateway.api.servers import ServerThread, Upstream
from tests.gateway.key_records import key_record


class Broken(ChatRenderer):
    def __init__(self, step: str) -> None:
        super().__init__()
        self.step = step

    def _fail(self, step: str) -> None:
        if step == self.step:
            raise RuntimeError(f"{step} broke")

    def whole(self, call: Call, answer: Answer) -> bytes:
        self._fail("whole")
        return super().whole(call, answer)

    def opening(self, call: Call, first: Chunk) -> bytes:
        self._fail("opening")
        return super().opening(call, first)

    def closing(self, call: Call) -> bytes:
        self._fail("closing")
        return super().closing(call)


@pytest.fixture(scope="module")
def upstream_url() -> Iterator[str]:
    server = ServerThread(Upstream()).start()
    yield server.url + "/v1"
    server.stop()


class Gateway:
    def __init__(self, redis: Redis, redis_url: str, upstream_url: str) -> None:
        self.settings = Settings(
            redis_url=redis_url, usage_stream=f"sg:usage:test:{uuid.uuid4().hex[:10]}"
        )
        self.redis = redis
        self.limiter = RateLimiter(redis, slot_ttl_s=60)
        router = Router(self.settings, redis, routes=[])
        config = {"models": [{"name": "echo", "deployments": [
            {"provider": "openai", "base_url": upstream_url, "model": "echo"}
        ]}]}  # fmt: skip
        for route in router.routes_from_config(config):
            router._add(route)
        self.router = router
        self.services = Services(
            settings=self.settings,
            router=router,
            limiter=self.limiter,
            recorder=UsageRecorder(redis, self.settings),
            redis=redis,
        )
        self.key = key_record(max_parallel_requests=1, token_budget=10_000)

    async def call(self, *, stream: bool) -> Call:
        request_id = uuid.uuid4().hex
        body = ChatRequest(
            model="echo", messages=[Message("user", [TextPart("hello there")])], stream=stream
        )
        body.sampling.max_tokens = 50
        body.request_id = request_id
        body.deadline = time.time() + 30
        admission = await self.limiter.admit(self.key, request_id, 60, prompt_tokens=10)
        route = await self.router.resolve("echo")
        assert route is not None
        return Call(
            services=self.services,
            key=self.key,
            route=route,
            request=body,
            admission=admission,
            request_id=request_id,
            response_id="chatcmpl-" + request_id,
            created=int(time.time()),
            public_model="echo",
            prompt_estimate=10,
            prompt_param="messages",
            started=time.perf_counter(),
            span=INVALID_SPAN,
        )

    async def slots(self) -> int:
        return int(await self.redis.zcard(f"sg:rl:{{{self.key.id}}}:slots"))

    async def budget_used(self) -> int:
        return (await self.limiter.counters("key", self.key, None))[0]


@pytest.fixture
async def gateway(redis_url: str, upstream_url: str) -> AsyncIterator[Gateway]:
    redis = Redis.from_url(redis_url)
    gateway = Gateway(redis, redis_url, upstream_url)
    yield gateway
    names = [name async for name in redis.scan_iter(f"sg:rl:{{{gateway.key.id}}}*")]
    await redis.delete(*names, gateway.settings.usage_stream)
    await gateway.router.close()
    await redis.aclose()


async def serve(response: Any) -> bytes:
    """What Litestar does with a streamed response: send the body, then run its background
    task, which it skips when the body raised."""
    messages: list[Any] = []

    async def send(message: Any) -> None:
        messages.append(message)

    await response.relay(send)
    assert [m["more_body"] for m in messages] == [True] * (len(messages) - 1) + [False]
    await response.background()
    return b"".join(m["body"] for m in messages)


async def test_a_whole_answer_that_fails_to_render_is_settled(gateway: Gateway) -> None:
    call = await gateway.call(stream=False)
    assert await gateway.slots() == 1
    with pytest.raises(RuntimeError):
        await call.complete(Broken("whole"))
    assert call.finished and call.status == "error"
    assert await gateway.slots() == 0
    # The prompt was read, nothing of the answer reached the client.
    assert await gateway.budget_used() == call.billed().prompt_tokens


@pytest.mark.parametrize("step", ["opening", "closing"])
async def test_a_stream_whose_renderer_fails_ends_with_an_error_event_and_is_settled(
    gateway: Gateway, step: str
) -> None:
    call = await gateway.call(stream=True)
    response = await stream(call, Broken(step))
    body = await serve(response)
    assert b"server_error" in body
    assert call.finished and call.status == "error"
    assert await gateway.slots() == 0
    billed = call.billed()
    assert await gateway.budget_used() == billed.prompt_tokens + billed.completion_tokens

"""The engine provider's resumption, against real Redis and a scripted worker that speaks the
wire protocol: a stream whose worker is lost goes on from the tokens already delivered, and
fails only when no worker takes the resumed request within ``resume_timeout_s``."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis

from sluicegate.engine import protocol, redis_names
from sluicegate.gateway.canonical import ChatRequest, Sampling
from sluicegate.gateway.providers.base import ProviderError
from sluicegate.gateway.providers.engine.provider import EngineProvider
from sluicegate.gateway.settings import Settings


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def _announce(redis: Redis, model: str, *workers: str) -> None:
    for worker in workers:
        beat = protocol.Heartbeat(worker, model, model, "test", time.time())
        await redis.set(redis_names.heartbeat_key(model, worker), protocol.encode(beat), ex=60)
        await redis.sadd(redis_names.worker_registry(model), worker)


async def _next_request(redis: Redis, model: str, after: list[bytes]) -> protocol.Request:
    while True:
        reply = await redis.xread({redis_names.request_stream(model): after[0]}, block=2000)
        for _, entries in reply or []:
            for entry_id, fields in entries:
                after[0] = entry_id
                message = protocol.decode(fields[redis_names.MESSAGE_FIELD])
                assert isinstance(message, protocol.Request)
                return message


async def _reply(redis: Redis, request: protocol.Request, *messages: Any) -> None:
    for message in messages:
        await redis.xadd(request.reply_key(), {redis_names.MESSAGE_FIELD: protocol.encode(message)})


def _delta(request: protocol.Request, worker: str, seq: int, token: int, **kw: Any) -> Any:
    return protocol.Delta(
        request.request_id, seq, chr(ord("a") + token), [token], worker_id=worker, **kw
    )


async def _collect(provider: EngineProvider, request: ChatRequest) -> tuple[str, Any]:
    text, usage = "", None
    async for chunk in provider.generate(request):
        text += "".join(c.text for c in chunk.choices)
        usage = chunk.usage or usage
    return text, usage


def _request(model: str, max_tokens: int = 5) -> ChatRequest:
    request = ChatRequest(model=model, prompt="hello", sampling=Sampling(max_tokens=max_tokens))
    request.request_id = uuid.uuid4().hex
    request.deadline = time.time() + 30
    return request


async def test_a_lost_stream_resumes_with_the_delivered_tokens(
    redis: Redis, redis_url: str
) -> None:
    model = f"resume-{uuid.uuid4().hex[:8]}"
    await _announce(redis, model, "w1", "w2")
    provider = EngineProvider(redis, Settings(redis_url=redis_url), model, prefix_affinity=False)
    request = _request(model)
    collecting = asyncio.create_task(_collect(provider, request))
    after = [b"0-0"]
    first = await _next_request(redis, model, after)
    usage = protocol.Usage(7, 0)
    await _reply(redis, first, _delta(first, "w1", 0, 0, usage=usage), _delta(first, "w1", 1, 1))
    # w1 died; w2 claimed its entry and, tokens having gone out, answers worker_lost.
    lost = protocol.Error(first.request_id, "worker_lost", "lost", worker_id="w2")
    await _reply(redis, first, lost)
    resumed = await _next_request(redis, model, after)
    assert resumed.request_id == redis_names.attempt_id(request.request_id, 1)
    assert resumed.resume_token_ids == [0, 1]
    assert resumed.sampling == first.sampling  # max_tokens counts the resumed tokens too
    final = protocol.Usage(7, 5)
    await _reply(
        redis,
        resumed,
        _delta(resumed, "w2", 0, 2, usage=protocol.Usage(7, 2)),
        _delta(resumed, "w2", 1, 3),
        _delta(resumed, "w2", 2, 4, finish_reason="length", usage=final),
    )
    text, usage = await asyncio.wait_for(collecting, 10)
    assert text == "abcde"
    assert (usage.prompt_tokens, usage.completion_tokens) == (7, 5)
    await provider.close()
    await redis.delete(redis_names.request_stream(model), redis_names.worker_registry(model))


async def test_no_taker_within_resume_timeout_is_the_clients_error(
    redis: Redis, redis_url: str
) -> None:
    model = f"resume-{uuid.uuid4().hex[:8]}"
    await _announce(redis, model, "w1", "w2")
    settings = Settings(redis_url=redis_url, resume_timeout_s=1.0)
    provider = EngineProvider(redis, settings, model, prefix_affinity=False)
    collecting = asyncio.create_task(_collect(provider, _request(model)))
    after = [b"0-0"]
    first = await _next_request(redis, model, after)
    await _reply(redis, first, _delta(first, "w1", 0, 0, usage=protocol.Usage(7, 0)))
    await _reply(redis, first, protocol.Error(first.request_id, "worker_lost", "lost"))
    await _next_request(redis, model, after)  # submitted again, but nobody answers
    began = time.monotonic()
    with pytest.raises(ProviderError) as raised:
        await asyncio.wait_for(collecting, 10)
    assert raised.value.code == "worker_lost"
    assert "within 1s" in raised.value.message
    assert time.monotonic() - began < 5
    assert raised.value.usage is not None and raised.value.usage.completion_tokens == 1
    await provider.close()
    await redis.delete(redis_names.request_stream(model), redis_names.worker_registry(model))

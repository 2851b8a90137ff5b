"""Redis comes back empty (a restart without persistence): the workers' registry and heartbeat
keys are gone until each worker beats again, though the workers themselves are alive. The
provider keeps trusting the workers it saw for one heartbeat TTL from when it found the
registry gone, so a request arriving meanwhile is submitted (and served) instead of a 503;
after that TTL without a beat they are gone. A worker whose own key expired while the
registry still lists it is dead at once, as before. And a Redis error on submission (a
restart leaves stale pooled connections) does not put the engine deployment into cooldown:
that would stretch a blip into ``cooldown_s`` of 503s after Redis is back."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from sluicegate.engine import protocol, redis_names
from sluicegate.gateway.canonical import ChatRequest, Sampling
from sluicegate.gateway.errors import ServiceUnavailable
from sluicegate.gateway.providers.base import ProviderError
from sluicegate.gateway.providers.engine.provider import EngineProvider
from sluicegate.gateway.routing.router import Deployment, ModelRoute, Router
from sluicegate.gateway.settings import Settings

TTL_S = 1.0
CACHE_S = 0.3
"""A little over the provider's worker cache, so the next call reads Redis again."""


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
def model() -> str:
    return f"loss-{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def provider(redis: Redis, redis_url: str, model: str) -> AsyncIterator[EngineProvider]:
    settings = Settings(redis_url=redis_url, worker_heartbeat_ttl_s=TTL_S)
    provider = EngineProvider(redis, settings, model, prefix_affinity=False)
    yield provider
    await provider.close()
    await redis.delete(
        redis_names.request_stream(model),
        redis_names.worker_registry(model),
        redis_names.heartbeat_key(model, "w1"),
    )


async def _announce(redis: Redis, model: str, worker: str) -> None:
    beat = protocol.Heartbeat(worker, model, model, "test", time.time())
    await redis.set(redis_names.heartbeat_key(model, worker), protocol.encode(beat), ex=60)
    await redis.sadd(redis_names.worker_registry(model), worker)


async def _lose_everything(redis: Redis, model: str) -> None:
    """What a Redis restart without persistence leaves of this model: nothing."""
    await redis.delete(
        redis_names.worker_registry(model),
        redis_names.heartbeat_key(model, "w1"),
        redis_names.request_stream(model),
    )


async def _serve_one(redis: Redis, model: str) -> None:
    """A worker that is alive but has not beaten since Redis came back: it answers one."""
    while True:
        reply = await redis.xread({redis_names.request_stream(model): "0-0"}, block=2000)
        for _, entries in reply or []:
            for _, fields in entries:
                request = protocol.decode(fields[redis_names.MESSAGE_FIELD])
                assert isinstance(request, protocol.Request)
                delta = protocol.Delta(
                    request.request_id,
                    0,
                    "hi",
                    [1],
                    finish_reason="stop",
                    usage=protocol.Usage(3, 1),
                    worker_id="w1",
                )
                message = {redis_names.MESSAGE_FIELD: protocol.encode(delta)}
                await redis.xadd(request.reply_key(), message)  # type: ignore[arg-type]
                return


def _request(model: str) -> ChatRequest:
    request = ChatRequest(model=model, prompt="hello", sampling=Sampling(max_tokens=4))
    request.request_id = uuid.uuid4().hex
    request.deadline = time.time() + 20
    return request


async def test_workers_seen_before_redis_lost_its_data_still_serve(
    redis: Redis, model: str, provider: EngineProvider
) -> None:
    await _announce(redis, model, "w1")
    assert await provider.is_available()
    await _lose_everything(redis, model)
    await asyncio.sleep(CACHE_S)
    assert await provider.is_available(), "503 while the worker re-registers"
    worker = asyncio.create_task(_serve_one(redis, model))
    text = ""
    async for chunk in provider.generate(_request(model)):
        text += "".join(c.text for c in chunk.choices)
    await asyncio.wait_for(worker, 5)
    assert text == "hi"


async def test_after_a_ttl_without_a_beat_they_are_gone(
    redis: Redis, model: str, provider: EngineProvider
) -> None:
    await _announce(redis, model, "w1")
    assert await provider.is_available()
    await asyncio.sleep(TTL_S)  # the sighting is old, but the loss is new: it is trusted
    await _lose_everything(redis, model)
    await asyncio.sleep(CACHE_S)
    assert await provider.is_available()
    await asyncio.sleep(TTL_S)
    assert not await provider.is_available()
    with pytest.raises(ProviderError) as refused:
        await anext(aiter(provider.generate(_request(model))))
    assert refused.value.code == "no_worker_available"
    await _announce(redis, model, "w1")  # it beats again
    await asyncio.sleep(CACHE_S)
    assert await provider.is_available()


async def test_a_worker_whose_key_expired_is_gone_at_once(
    redis: Redis, model: str, provider: EngineProvider
) -> None:
    await _announce(redis, model, "w1")
    assert await provider.is_available()
    await redis.delete(redis_names.heartbeat_key(model, "w1"))  # the registry still lists it
    await asyncio.sleep(CACHE_S)
    assert not await provider.is_available()


async def test_a_redis_error_on_submission_does_not_cool_the_deployment(
    redis: Redis, redis_url: str, model: str, provider: EngineProvider
) -> None:
    await _announce(redis, model, "w1")
    # The request stream holds a string: XADD fails with a Redis error, as on a stale
    # connection right after a restart, while the workers' heartbeats read fine.
    await redis.set(redis_names.request_stream(model), "not a stream")
    settings = Settings(redis_url=redis_url, cooldown_failures=1, upstream_retries=0)
    deployment = Deployment(provider, kind="engine", model=model)
    route = ModelRoute(model, deployments=[deployment])
    router = Router(settings, redis, routes=[route])
    with pytest.raises(ServiceUnavailable) as refused:
        await router.complete(route, _request(model))
    assert "engine transport (Redis) is unavailable" in refused.value.message
    assert not deployment.cooling() and deployment.failures == 0
    await redis.delete(redis_names.request_stream(model))
    worker = asyncio.create_task(_serve_one(redis, model))
    _, answer = await router.complete(route, _request(model))
    await asyncio.wait_for(worker, 5)
    assert answer.text() == "hi"

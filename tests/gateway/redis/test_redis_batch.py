"""The request path's Redis commands joined into pipelines under load, on the real Redis."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from sluicegate.gateway.redis.batch import CommandBatcher


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def test_concurrent_commands_share_round_trips_and_each_gets_its_replies(
    redis: Redis,
) -> None:
    batcher = CommandBatcher(redis)
    prefix = f"sg:test:batch:{uuid.uuid4().hex}"
    # Alone: sent at once, one round trip.
    assert await batcher.execute(("SET", f"{prefix}:0", "zero")) == [True]
    assert batcher.round_trips == 1

    async def client(i: int) -> list[object]:
        return await batcher.execute(("INCRBY", f"{prefix}:{i}", i), ("GET", f"{prefix}:{i}"))

    replies = await asyncio.gather(*(client(i) for i in range(1, 51)))
    assert replies == [[i, str(i).encode()] for i in range(1, 51)]
    # The first went alone, and so did the second: behind a single exchange in flight (a
    # sequential client's admission behind its last settle) waiting a loop turn gains nothing.
    # The 48 issued while two were in flight went as one pipeline.
    assert batcher.round_trips == 4
    await redis.delete(*(f"{prefix}:{i}" for i in range(51)))


async def test_an_error_reaches_only_the_command_that_caused_it(redis: Redis) -> None:
    batcher = CommandBatcher(redis)
    key = f"sg:test:batch:{uuid.uuid4().hex}"
    assert await batcher.execute(("SET", key, "text")) == [True]
    # The first two go alone; the third, issued while two are in flight, is queued (on
    # other connections: nothing orders them after the first, hence the SET before).
    alone, good, bad = await asyncio.gather(
        batcher.execute(("GET", key)),
        batcher.execute(("GET", key)),
        batcher.execute(("INCR", key), ("GET", key)),
    )
    assert alone == good == [b"text"]
    assert isinstance(bad[0], ResponseError)  # not an integer
    assert bad[1] == b"text"
    alone = await batcher.execute(("EVALSHA", "0" * 40, 0))
    assert isinstance(alone[0], ResponseError)  # NOSCRIPT, as a pipeline would answer it
    await redis.delete(key)


async def test_a_lost_connection_fails_every_request_of_the_batch(redis_url: str) -> None:
    dead = Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=1)
    batcher = CommandBatcher(dead)
    results = await asyncio.gather(
        *(batcher.execute(("GET", "k")) for _ in range(3)), return_exceptions=True
    )
    assert all(
        isinstance(result, ConnectionError | OSError) or "Connection" in type(result).__name__
        for result in results
    ), results
    await dead.aclose()

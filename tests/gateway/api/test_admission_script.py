"""The admission Lua script's arithmetic, driven with chosen clocks against the real Redis."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from gateway.limits import ADMIT_LUA, SETTLE_LUA, format_reset


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


def _keys(tag: str) -> list[str]:
    return [f"{tag}:r:1", f"{tag}:r:0", f"{tag}:t:1", f"{tag}:t:0", f"{tag}:slots", f"{tag}:b"]


async def _admit(
    redis: Redis,
    keys: list[str],
    *,
    elapsed: float,
    rpm: int = -1,
    tpm: int = -1,
    cost: int = 0,
    parallel: int = -1,
    budget: int = -1,
    request_id: str = "r",
) -> list[int]:
    window_start = 60.0
    args = [window_start + elapsed, window_start, 60, rpm, tpm, cost, parallel, budget]
    return await redis.eval(ADMIT_LUA, len(keys), *keys, *args, request_id, 30, 3600)  # type: ignore[no-any-return]


async def test_sliding_window_weights_the_previous_minute(redis: Redis) -> None:
    keys = _keys(f"sg:rl:{{{uuid.uuid4().hex}}}")
    await redis.set(keys[1], 10, ex=60)  # 10 requests in the previous minute
    # Half-way through this minute half of them still count: 5 more fit under 10/min.
    for i in range(5):
        code, *_ = await _admit(redis, keys, elapsed=30, rpm=10)
        assert code == 0, i
    code, retry_ms, left, reset_ms, *_ = await _admit(redis, keys, elapsed=30, rpm=10)
    assert (code, left) == (1, 0)
    # 10*w + 5 + 1 <= 10 needs w <= 0.4, i.e. 36 s into the minute: 6 s from now.
    assert retry_ms == 6000
    assert reset_ms == 90_000  # this minute's 5 drain by the end of the next one
    await redis.delete(*keys)


async def test_tokens_budget_and_slots_book_together_or_not_at_all(redis: Redis) -> None:
    keys = _keys(f"sg:rl:{{{uuid.uuid4().hex}}}")
    first = await _admit(
        redis, keys, elapsed=1, tpm=100, cost=60, parallel=2, budget=100, request_id="a"
    )
    assert first[0] == 0 and first[4] == 40
    # Over the budget: nothing of this attempt is booked.
    over = await _admit(
        redis, keys, elapsed=1, tpm=1000, cost=50, parallel=2, budget=100, request_id="b"
    )
    assert over[0] == 4
    assert int(await redis.get(keys[2])) == 60
    assert int(await redis.get(keys[5])) == 60
    assert await redis.zcard(keys[4]) == 1
    # Settling "a" at 15 real tokens gives back 45 and its slot.
    await redis.eval(SETTLE_LUA, 3, keys[2], keys[5], keys[4], 15 - 60, "a")
    assert int(await redis.get(keys[2])) == 15
    assert int(await redis.get(keys[5])) == 15
    assert await redis.zcard(keys[4]) == 0
    # A request larger than the whole per-minute limit can never pass: retry is -1.
    too_big = await _admit(redis, keys, elapsed=1, tpm=100, cost=101)
    assert too_big[:2] == [2, -1000]
    await redis.delete(*keys)


async def test_concurrency_slots_expire_with_their_owner(redis: Redis) -> None:
    keys = _keys(f"sg:rl:{{{uuid.uuid4().hex}}}")
    assert (await _admit(redis, keys, elapsed=0, parallel=1, request_id="a"))[0] == 0
    assert (await _admit(redis, keys, elapsed=1, parallel=1, request_id="b"))[0] == 3
    # The slot was booked until now + 30 s: a gateway that died does not hold it forever.
    assert (await _admit(redis, keys, elapsed=31, parallel=1, request_id="c"))[0] == 0
    await redis.delete(*keys)


def test_reset_durations_read_like_openai() -> None:
    assert [format_reset(ms) for ms in (0, 250, 1000, 7500, 60_000, 72_250)] == [
        "0ms",
        "250ms",
        "1s",
        "7.5s",
        "1m0s",
        "1m12.25s",
    ]

"""A settle corrects the counters its admission booked and bills the others in full.

A key without a token or money budget (or without a tokens/min limit) books nothing there at
admission, yet its budget counters can exist: the key's info and the admin reports seed them
from the database to show the spend. Settling such a request must add what it really used,
not subtract a reservation those counters never held (they showed -17 after a 17-token
reservation settled at 0)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from sluicegate.gateway.admission.limits import RateLimiter
from sluicegate.gateway.keys.records import ApiKeyRecord
from tests.gateway.key_records import key_record


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def _cleanup(redis: Redis, key: ApiKeyRecord) -> None:
    names = [name async for name in redis.scan_iter(f"sg:rl:{{{key.id}}}*")]
    if names:
        await redis.delete(*names)


@pytest.mark.parametrize("actual", [0, 5, 40])
async def test_counters_the_admission_did_not_book_get_the_real_amount(
    redis: Redis, actual: int
) -> None:
    limiter = RateLimiter(redis, slot_ttl_s=60)
    key = key_record()
    try:
        assert await limiter.counters("key", key, None) == (0, 0)  # seeded, shown
        admission = await limiter.admit(key, uuid.uuid4().hex, 17, prompt_tokens=5)
        await limiter.settle(admission, actual)
        assert await limiter.counters("key", key, None) == (actual, 0)
    finally:
        await _cleanup(redis, key)


async def test_a_budgeted_key_is_corrected_by_its_settle(redis: Redis) -> None:
    limiter = RateLimiter(redis, slot_ttl_s=60)
    key = key_record(token_budget=1_000, tpm_limit=1_000)
    try:
        admission = await limiter.admit(key, uuid.uuid4().hex, 17, prompt_tokens=5)
        assert (await limiter.counters("key", key, None))[0] == 17
        await limiter.settle(admission, 9)
        assert (await limiter.counters("key", key, None))[0] == 9
    finally:
        await _cleanup(redis, key)

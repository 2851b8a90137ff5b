"""The admission Lua script's arithmetic, driven with chosen clocks against the real Redis."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis
from redis.crc import key_slot

from sluicegate.gateway.admission.limits import RateLimiter
from sluicegate.gateway.admission.replies import format_reset
from sluicegate.gateway.admission.scripts import ADMIT_LUA, SETTLE_LUA
from sluicegate.gateway.keys.records import ApiKeyRecord, TeamLimits


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


def _keys(tag: str) -> list[str]:
    return [
        f"{tag}:r:1",
        f"{tag}:r:0",
        f"{tag}:t:1",
        f"{tag}:t:0",
        f"{tag}:slots",
        f"{tag}:b",
        f"{tag}:m",
    ]


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
    """One scope; answers like before: code, retry, then its four header numbers."""
    if budget >= 0 and not await redis.exists(keys[5]):
        await redis.set(keys[5], 0)
    window_start = 60.0
    args = [window_start + elapsed, window_start, 60, cost, 0, request_id, 30, 1]
    args += [rpm, tpm, parallel, budget, -1, 3600]
    code, _, retry, _, *headers = await redis.eval(ADMIT_LUA, len(keys), *keys, *args)
    return [code, retry, *headers]


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


async def test_window_counters_expire_two_windows_after_they_were_made(redis: Redis) -> None:
    keys = _keys(f"sg:rl:{{{uuid.uuid4().hex}}}")
    for request_id in ("a", "b"):
        code, *_ = await _admit(
            redis, keys, elapsed=1, rpm=10, tpm=100, cost=5, request_id=request_id
        )
        assert code == 0
    # Made by the first admission with two windows to live; the second does not extend them.
    await redis.expire(keys[0], 90)
    await redis.expire(keys[2], 90)
    code, *_ = await _admit(redis, keys, elapsed=2, rpm=10, tpm=100, cost=5, request_id="c")
    assert code == 0
    assert (int(await redis.get(keys[0])), int(await redis.get(keys[2]))) == (3, 15)
    assert 0 < await redis.ttl(keys[0]) <= 90
    assert 0 < await redis.ttl(keys[2]) <= 90
    await redis.delete(*keys)
    code, *_ = await _admit(redis, keys, elapsed=1, rpm=10, tpm=100, cost=5, request_id="d")
    assert 110 < await redis.ttl(keys[0]) <= 120
    assert 110 < await redis.ttl(keys[2]) <= 120
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
    await redis.eval(SETTLE_LUA, 4, keys[2], keys[5], keys[6], keys[4], 15 - 60, 0, "a")
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


def test_a_team_keys_counters_and_the_teams_share_one_cluster_slot(redis: Redis) -> None:
    team = TeamLimits(
        id=str(uuid.uuid4()),
        name="t",
        allowed_models=[],
        rpm_limit=10,
        tpm_limit=100,
        max_parallel_requests=2,
        token_budget=1000,
        max_budget_micros=5000,
        budget_period="day",
    )
    key = ApiKeyRecord(
        id=str(uuid.uuid4()),
        name="k",
        allowed_models=[],
        rpm_limit=5,
        tpm_limit=None,
        max_parallel_requests=None,
        token_budget=None,
        budget_period=None,
        expires_at=None,
        revoked=False,
        metadata={},
        max_budget_micros=100,
        team=team,
    )
    keys, _ = RateLimiter(redis, slot_ttl_s=1)._admission_call(key, "r", 10, 20, time.time())
    assert len(keys) == 16  # seven per scope, then the reservation's held marker and epoch
    assert keys[14] == f"sg:rl:{{{team.id}}}:k:{key.id}:held:r"
    assert keys[15] == f"sg:rl:{{{team.id}}}:k:{key.id}:epoch"
    assert len({key_slot(name.encode()) for name in keys}) == 1
    assert all(name.startswith(f"sg:rl:{{{team.id}}}:") for name in keys)
    assert keys[6].startswith(f"sg:rl:{{{team.id}}}:k:{key.id}:m:")
    assert keys[13].startswith(f"sg:rl:{{{team.id}}}:team:m:")


async def _admit_held(redis: Redis, keys: list[str], request_id: str, epoch: str) -> str:
    """Admit 60 tokens (1000 a minute, a budget of 1000); the epoch the admission saw."""
    args = [61.0, 60.0, 60, 60, 0, request_id, 30, 1, -1, 1000, 2, 1000, -1, 3600, epoch]
    result = await redis.eval(ADMIT_LUA, len(keys), *keys, *args)
    assert result[0] == 0
    return result[8].decode()  # after four header numbers: the epoch, then the headroom


async def test_a_reservation_settled_twice_is_corrected_once(redis: Redis) -> None:
    """The serving replica and a lease reaper may both settle one request: the held marker
    booked at admission lets only the first settle move the counters (both free the slot)."""
    tag = f"sg:rl:{{{uuid.uuid4().hex}}}"
    keys = [*_keys(tag), f"{tag}:held:a", f"{tag}:epoch"]
    await redis.set(keys[5], 0)
    epoch = await _admit_held(redis, keys, "a", "e1")
    assert epoch == "e1" and await redis.exists(keys[7])
    assert await _admit_held(redis, [*keys[:7], f"{tag}:held:b", keys[8]], "b", "e2") == "e1"
    settle = [keys[2], keys[5], keys[6], keys[4], keys[7], keys[8]]
    for real in (15, 20):
        await redis.eval(SETTLE_LUA, len(settle), *settle, real - 60, 0, "a", epoch, 60, 0)
    assert int(await redis.get(keys[2])) == 15 + 60  # "b" still holds its 60
    assert int(await redis.get(keys[5])) == 15 + 60
    assert await redis.zcard(keys[4]) == 1
    assert not await redis.exists(keys[7])
    await redis.delete(*keys, f"{tag}:held:b")


async def test_a_reservation_redis_lost_is_settled_in_full(redis: Redis) -> None:
    """Redis restarted empty between admission and settle: the budget counter was re-seeded
    (here: 100 tokens of earlier usage) without the reservation, so it takes the real count."""
    tag = f"sg:rl:{{{uuid.uuid4().hex}}}"
    keys = [*_keys(tag), f"{tag}:held:a", f"{tag}:epoch"]
    await redis.set(keys[5], 0)
    epoch = await _admit_held(redis, keys, "a", "before")
    await redis.delete(*keys)  # the restart
    await redis.set(keys[5], 100)  # re-seeded from the database
    await _admit_held(redis, [*keys[:7], f"{tag}:held:b", keys[8]], "b", "after")
    settle = [keys[2], keys[5], keys[6], keys[4], keys[7], keys[8]]
    await redis.eval(SETTLE_LUA, len(settle), *settle, 15 - 60, 0, "a", epoch, 60, 0)
    assert int(await redis.get(keys[5])) == 100 + 60 + 15  # seed + b's reservation + a's 15
    await redis.delete(*keys, f"{tag}:held:b")


async def test_an_admission_reports_the_headroom_it_left(redis: Redis) -> None:
    """After a booking: the largest share of any limit now used (permille), and the tokens
    and micros left before the nearest token and money limit (sluicegate.gateway.admission.speculation)."""
    tag = f"sg:rl:{{{uuid.uuid4().hex}}}"
    keys = [*_keys(tag), f"{tag}:held:a", f"{tag}:epoch"]
    await redis.set(keys[5], 100)
    await redis.set(keys[6], 0)
    # 40 tokens of 1000/min and of a 500 budget (100 spent), 1 of 4 slots, 1 of 10 req/min,
    # 30 of 300 micros.
    args = [61.0, 60.0, 60, 40, 30, "a", 30, 1, 10, 1000, 4, 500, 300, 3600, "e"]
    result = await redis.eval(ADMIT_LUA, len(keys), *keys, *args)
    assert result[0] == 0
    assert result[9:] == [280, 360, 270]  # the budget: 140 of 500 spent
    unlimited = [61.0, 60.0, 60, 40, 0, "b", 30, 1, -1, -1, -1, -1, -1, 3600, "e"]
    held_b = [*keys[:7], f"{tag}:held:b", keys[8]]
    result = await redis.eval(ADMIT_LUA, len(held_b), *held_b, *unlimited)
    assert result[9:] == [0, -1, -1]
    await redis.delete(*keys, held_b[7])

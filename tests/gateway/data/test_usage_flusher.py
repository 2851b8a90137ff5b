"""Usage records: XADDed by the recorder, flushed into PostgreSQL exactly once, whatever fails.

The database outage is real: the flusher talks to PostgreSQL through a TCP relay the test
takes down and brings back (``db_proxy``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from redis.asyncio import Redis
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluicegate.gateway.db.models import UsageDaily, UsageRecord
from sluicegate.gateway.db.session import create_engine, create_sessionmaker
from sluicegate.gateway.settings import Settings
from sluicegate.gateway.telemetry import USAGE_FLUSH_LAG
from sluicegate.gateway.usage.stream import FLUSHER_GROUP, UsageEvent, UsageFlusher, UsageRecorder

KEY_ID = str(uuid.uuid4())


def _event(index: int, *, model: str = "m1") -> UsageEvent:
    now = time.time()
    return UsageEvent(
        request_id=f"req-{index}",
        key_id=KEY_ID,
        model=model,
        deployment="engine:m1",
        prompt_tokens=10,
        completion_tokens=index,
        status="ok",
        finish_reason="stop",
        latency_ms=12.5,
        ttft_ms=3.0,
        started_at=now - 0.0125,
        finished_at=now,
    )


async def _stored(sessionmaker: async_sessionmaker[AsyncSession]) -> dict[str, int]:
    async with sessionmaker() as session:
        records, distinct, completion = (
            await session.execute(
                select(
                    func.count(),
                    func.count(UsageRecord.request_id.distinct()),
                    func.coalesce(func.sum(UsageRecord.completion_tokens), 0),
                )
            )
        ).one()
        requests, rolled_completion = (
            await session.execute(
                select(
                    func.coalesce(func.sum(UsageDaily.requests), 0),
                    func.coalesce(func.sum(UsageDaily.completion_tokens), 0),
                )
            )
        ).one()
    return {
        "records": records,
        "distinct": distinct,
        "completion": completion,
        "rollup_requests": requests,
        "rollup_completion": rolled_completion,
    }


def _expected(count: int, first: int = 0) -> dict[str, int]:
    completion = sum(range(first, first + count))
    return {
        "records": count,
        "distinct": count,
        "completion": completion,
        "rollup_requests": count,
        "rollup_completion": completion,
    }


async def _eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def _stream_drained(redis: Redis, stream: str) -> bool:
    pending = await redis.xpending(stream, FLUSHER_GROUP)
    return pending["pending"] == 0 and await redis.xlen(stream) == 0


@pytest.fixture
async def proxied_sessionmaker(db_proxy: Any) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    engine = create_engine(db_proxy.url)
    yield create_sessionmaker(engine)
    await engine.dispose()


async def test_recorded_events_are_flushed_exactly_once_by_concurrent_flushers(
    gateway_settings: Settings,
    redis_client: Redis,
    db_sessionmaker: async_sessionmaker[AsyncSession],
) -> None:
    settings = dataclasses.replace(gateway_settings, usage_flush_batch=7)
    recorder = UsageRecorder(redis_client, settings)
    flushers = [
        UsageFlusher(redis_client, db_sessionmaker, settings, consumer=name) for name in "ab"
    ]
    for flusher in flushers:
        await flusher.start()
    try:
        for index in range(60):
            await recorder.record(_event(index, model=("m1", "m2")[index % 2]))
        pipe = redis_client.pipeline(transaction=False)
        for index in range(10):
            recorder.record_in(pipe, _event(index))  # replays of records already sent
        await pipe.execute()
        await _eventually(lambda: _stream_drained(redis_client, settings.usage_stream))
        await _eventually(lambda: _flushed(flushers, 60))
    finally:
        for flusher in flushers:
            await flusher.stop()
    assert await _stored(db_sessionmaker) == _expected(60)
    async with db_sessionmaker() as session:
        per_model = dict(
            (await session.execute(select(UsageDaily.model, UsageDaily.requests))).tuples().all()
        )
        record = await session.get(UsageRecord, "req-3")
    assert per_model == {"m1": 30, "m2": 30}
    assert record is not None and record.key_id == uuid.UUID(KEY_ID)
    assert record.finish_reason == "stop" and record.ttft_ms == 3.0
    assert record.finished_at > record.started_at


async def _flushed(flushers: list[UsageFlusher], count: int) -> bool:
    return sum(flusher.flushed for flusher in flushers) >= count


async def test_database_outage_delays_records_but_loses_none(
    gateway_settings: Settings,
    redis_client: Redis,
    db_sessionmaker: async_sessionmaker[AsyncSession],
    db_proxy: Any,
    proxied_sessionmaker: async_sessionmaker[AsyncSession],
) -> None:
    """Acceptance 4: PostgreSQL goes away while requests are recorded, then comes back."""
    recorder = UsageRecorder(redis_client, gateway_settings)
    flusher = UsageFlusher(redis_client, proxied_sessionmaker, gateway_settings, max_backoff_s=0.2)
    await flusher.start()
    try:
        for index in range(10):
            await recorder.record(_event(index))
        await _eventually(lambda: _has(db_sessionmaker, 10))

        await db_proxy.stop()
        for index in range(10, 40):
            await recorder.record(_event(index))
        # The flusher holds the batch and keeps failing to commit it.
        await _eventually(lambda: _pending_at_least(redis_client, gateway_settings, 1))
        await asyncio.sleep(0.5)
        assert (await _stored(db_sessionmaker))["records"] == 10
        assert USAGE_FLUSH_LAG._value.get() > 0.3
        for index in range(40, 50):
            await recorder.record(_event(index))

        await db_proxy.start()
        await _eventually(lambda: _stream_drained(redis_client, gateway_settings.usage_stream))
    finally:
        await flusher.stop()
    assert await _stored(db_sessionmaker) == _expected(50)


async def _has(sessionmaker: async_sessionmaker[AsyncSession], count: int) -> bool:
    return (await _stored(sessionmaker))["records"] >= count


async def _pending_at_least(redis: Redis, settings: Settings, count: int) -> bool:
    return (await redis.xpending(settings.usage_stream, FLUSHER_GROUP))["pending"] >= count


async def test_dead_flushers_batches_are_reclaimed_without_double_counting(
    gateway_settings: Settings,
    redis_client: Redis,
    db_sessionmaker: async_sessionmaker[AsyncSession],
) -> None:
    settings = dataclasses.replace(gateway_settings, usage_flush_batch=10)
    recorder = UsageRecorder(redis_client, settings)
    for index in range(30):
        await recorder.record(_event(index))

    dead = UsageFlusher(redis_client, db_sessionmaker, settings, consumer="dead")
    await dead.ensure_group()
    committed = await dead.read_new()
    assert await dead.write(committed)  # dies after the commit, before the XACK
    await dead.read_new()  # dies holding a batch it never wrote
    assert (await _stored(db_sessionmaker))["records"] == 10

    heir = UsageFlusher(redis_client, db_sessionmaker, settings, consumer="heir", claim_idle_s=0.1)
    await asyncio.sleep(0.15)
    await heir.start()
    try:
        await _eventually(lambda: _stream_drained(redis_client, settings.usage_stream))
    finally:
        await heir.stop()
    assert await _stored(db_sessionmaker) == _expected(30)
    assert heir.flushed == 20, "the replayed committed batch must not be inserted again"


async def test_flusher_killed_during_an_outage_is_taken_over(
    gateway_settings: Settings,
    redis_client: Redis,
    db_sessionmaker: async_sessionmaker[AsyncSession],
    db_proxy: Any,
    proxied_sessionmaker: async_sessionmaker[AsyncSession],
) -> None:
    recorder = UsageRecorder(redis_client, gateway_settings)
    await db_proxy.stop()
    doomed = UsageFlusher(redis_client, proxied_sessionmaker, gateway_settings, consumer="doomed")
    await doomed.start()
    for index in range(25):
        await recorder.record(_event(index))
    await _eventually(lambda: _pending_at_least(redis_client, gateway_settings, 1))
    task = doomed._task
    assert task is not None
    task.cancel()  # killed mid-batch, nothing acknowledged
    await asyncio.gather(task, return_exceptions=True)

    heir = UsageFlusher(
        redis_client, db_sessionmaker, gateway_settings, consumer="heir", claim_idle_s=0.1
    )
    await heir.start()
    try:
        await _eventually(lambda: _stream_drained(redis_client, gateway_settings.usage_stream))
    finally:
        await heir.stop()
    assert await _stored(db_sessionmaker) == _expected(25)


async def test_malformed_entries_do_not_block_the_stream(
    gateway_settings: Settings,
    redis_client: Redis,
    db_sessionmaker: async_sessionmaker[AsyncSession],
) -> None:
    recorder = UsageRecorder(redis_client, gateway_settings)
    await recorder.record(_event(0))
    await redis_client.xadd(gateway_settings.usage_stream, {b"e": b"{not json"})
    await redis_client.xadd(
        gateway_settings.usage_stream,
        {
            b"e": b'{"request_id":"x","key_id":"not-a-uuid","model":"m","started_at":1,"finished_at":2}'
        },
    )
    await recorder.record(_event(1))
    flusher = UsageFlusher(redis_client, db_sessionmaker, gateway_settings)
    await flusher.start()
    try:
        await _eventually(lambda: _stream_drained(redis_client, gateway_settings.usage_stream))
    finally:
        await flusher.stop()
    assert await _stored(db_sessionmaker) == _expected(2)

"""SLUICEGATE_USAGE_RETENTION_DAYS: old usage records go, in bounded batches; rollups stay."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import time
import uuid
from typing import Any

import pytest
from redis.asyncio import Redis
from sqlalchemy import func, select, text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluicegate.gateway.db import usage_reports as usage_queries
from sluicegate.gateway.db.models import UsageRecord
from sluicegate.gateway.db.usage import insert_usage
from sluicegate.gateway.db.usage_upkeep import delete_usage_records_before
from sluicegate.gateway.settings import Settings
from sluicegate.gateway.usage.retention import UsageRetention
from sluicegate.gateway.usage.stream import UsageFlusher

from .usage_rows import usage_row

NOW = dt.datetime(2026, 6, 15, 9, 30, tzinfo=dt.UTC)
ROLLUPS = (
    "usage_daily",
    "usage_daily_keys",
    "usage_daily_models",
    "usage_daily_totals",
    "usage_monthly",
    "usage_monthly_keys",
)


def _ago(days: float) -> dt.datetime:
    return NOW - dt.timedelta(days=days)


async def _request_ids(sessionmaker: async_sessionmaker[AsyncSession]) -> set[str]:
    async with sessionmaker() as session:
        return set((await session.execute(select(UsageRecord.request_id))).scalars())


async def _rollups(sessionmaker: async_sessionmaker[AsyncSession]) -> dict[str, list[Any]]:
    async with sessionmaker() as session:
        return {
            table: [
                tuple(row)
                for row in (
                    await session.execute(text(f"SELECT * FROM {table} ORDER BY 1, 2, 3, 4"))
                )
            ]
            for table in ROLLUPS
        }


async def _reports(sessionmaker: async_sessionmaker[AsyncSession], team: str) -> list[Any]:
    async with sessionmaker() as session:
        return [
            await usage_queries.usage_totals(session),
            *[
                await usage_queries.usage_totals(session, group_by=group)  # type: ignore[arg-type]
                for group in ("day", "model", "key", "team")
            ],
            await usage_queries.usage_totals(session, team_id=uuid.UUID(team), group_by="day"),
            await usage_queries.daily_by_model(session, since=_ago(60).date()),
            await usage_queries.models_used(session),
            await usage_queries.spent_since(session, team_id=uuid.UUID(team), since=None),
        ]


def _named(request_id: str, when: dt.datetime, *, team: str | None = None) -> dict[str, Any]:
    key = "00000000-0000-0000-0000-0000000000aa"
    return {**usage_row(key, "m1", when, 10, 5, team_id=team), "request_id": request_id}


async def test_retention_deletes_old_records_and_keeps_recent_ones_and_every_rollup(
    db_sessionmaker: async_sessionmaker[AsyncSession],
) -> None:
    team = str(uuid.uuid4())
    old = {
        "45-days": _ago(45),
        "31-days": _ago(31),
        # 00:00 UTC 30 days before today is the first instant kept: a second before goes.
        "just-before": dt.datetime.combine(_ago(30).date(), dt.time(), dt.UTC)
        - dt.timedelta(seconds=1),
    }
    kept = {
        "first-kept": dt.datetime.combine(_ago(30).date(), dt.time(), dt.UTC),
        "29-days": _ago(29),
        "today": NOW,
    }
    async with db_sessionmaker() as session, session.begin():
        await insert_usage(
            session,
            [
                _named(name, when, team=team if i % 2 else None)
                for i, (name, when) in enumerate({**old, **kept}.items())
            ],
        )
    rollups = await _rollups(db_sessionmaker)
    reports = await _reports(db_sessionmaker, team)
    assert reports[0][0].requests == 6

    retention = UsageRetention(db_sessionmaker, 30, batch=2, pause_s=0)
    assert await retention.prune(NOW) == len(old)

    assert await _request_ids(db_sessionmaker) == set(kept)
    assert await _rollups(db_sessionmaker) == rollups
    assert await _reports(db_sessionmaker, team) == reports
    assert await retention.prune(NOW) == 0


async def test_each_delete_is_bounded_and_takes_the_oldest_first(
    db_sessionmaker: async_sessionmaker[AsyncSession],
) -> None:
    async with db_sessionmaker() as session, session.begin():
        await insert_usage(session, [_named(f"r{i}", _ago(100 - i)) for i in range(5)])
    cutoff = _ago(10)
    deleted = []
    for _ in range(4):
        async with db_sessionmaker() as session, session.begin():
            deleted.append(await delete_usage_records_before(session, cutoff, 2))
        if deleted[-1] == 2:
            assert await _request_ids(db_sessionmaker) == {
                f"r{i}" for i in range(len(deleted) * 2, 5)
            }
    assert deleted == [2, 2, 1, 0]


async def test_pruners_on_several_replicas_split_the_backlog(
    db_sessionmaker: async_sessionmaker[AsyncSession],
) -> None:
    async with db_sessionmaker() as session, session.begin():
        await insert_usage(
            session, [_named(f"old-{i}", _ago(40) - dt.timedelta(minutes=i)) for i in range(60)]
        )
        await insert_usage(session, [_named(f"new-{i}", _ago(1)) for i in range(5)])
    pruners = [UsageRetention(db_sessionmaker, 7, batch=4, pause_s=0) for _ in range(3)]
    assert sum(await asyncio.gather(*(p.prune(NOW) for p in pruners))) == 60
    assert await _request_ids(db_sessionmaker) == {f"new-{i}" for i in range(5)}


async def test_the_flusher_runs_retention_only_when_it_is_set(
    gateway_settings: Settings,
    redis_client: Redis,
    db_sessionmaker: async_sessionmaker[AsyncSession],
) -> None:
    now = dt.datetime.now(dt.UTC)
    async with db_sessionmaker() as session, session.begin():
        await insert_usage(
            session,
            [_named("ancient", now - dt.timedelta(days=400)), _named("fresh", now)],
        )
    assert UsageFlusher(redis_client, db_sessionmaker, gateway_settings).retention is None

    settings = dataclasses.replace(gateway_settings, usage_retention_days=365)
    flusher = UsageFlusher(redis_client, db_sessionmaker, settings)
    assert flusher.retention is not None and flusher.retention.days == 365
    await flusher.start()
    try:
        deadline = time.monotonic() + 10
        while await _request_ids(db_sessionmaker) != {"fresh"}:
            assert time.monotonic() < deadline, "retention did not run"
            await asyncio.sleep(0.05)
    finally:
        await flusher.stop()
    async with db_sessionmaker() as session:
        (total,) = await usage_queries.usage_totals(session)
        records = (await session.execute(select(func.count()).select_from(UsageRecord))).scalar()
    assert (total.requests, records) == (2, 1)


def test_retention_days_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings.from_env().usage_retention_days == 0
    monkeypatch.setenv("SLUICEGATE_USAGE_RETENTION_DAYS", "90")
    assert Settings.from_env().usage_retention_days == 90
    with pytest.raises(ValueError):
        UsageRetention(None, 0)  # type: ignore[arg-type]

"""SLUICEGATE_RESPONSE_RETENTION_DAYS: stored Responses past it go, oldest first, in batches."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import time
import uuid

import pytest
from litestar.testing import AsyncTestClient
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluicegate.gateway.app import create_app
from sluicegate.gateway.db.models import StoredResponse
from sluicegate.gateway.db.responses import Owner, insert_response
from sluicegate.gateway.settings import Settings
from sluicegate.gateway.stored.retention import ResponseRetention

NOW = dt.datetime(2026, 6, 15, 9, 30, tzinfo=dt.UTC)


async def _store(
    sessionmaker: async_sessionmaker[AsyncSession], name: str, created: dt.datetime
) -> None:
    owner = Owner(uuid.uuid4(), None)
    async with sessionmaker() as session, session.begin():
        await insert_response(session, owner, {"id": name}, [], created)


async def _kept(sessionmaker: async_sessionmaker[AsyncSession]) -> set[str]:
    async with sessionmaker() as session:
        return set((await session.execute(select(StoredResponse.id))).scalars())


async def test_responses_past_retention_go_in_batches(
    db_sessionmaker: async_sessionmaker[AsyncSession],
) -> None:
    for i in range(5):
        await _store(db_sessionmaker, f"resp_old{i}", NOW - dt.timedelta(days=31 + i))
    # 30 days keep whole UTC days: from 00:00 on May 16th, however late today it is.
    await _store(db_sessionmaker, "resp_edge", dt.datetime(2026, 5, 16, tzinfo=dt.UTC))
    await _store(db_sessionmaker, "resp_new", NOW)
    retention = ResponseRetention(db_sessionmaker, 30, batch=2, pause_s=0)
    assert await retention.prune(NOW) == 5
    assert await _kept(db_sessionmaker) == {"resp_edge", "resp_new"}
    assert await retention.prune(NOW) == 0


async def test_every_gateway_prunes_from_its_start(
    gateway_settings: Settings, db_sessionmaker: async_sessionmaker[AsyncSession]
) -> None:
    now = dt.datetime.now(dt.UTC)
    await _store(db_sessionmaker, "resp_expired", now - dt.timedelta(days=3))
    await _store(db_sessionmaker, "resp_recent", now)
    # No usage flusher: responses are written by every replica, so every replica prunes them.
    settings = dataclasses.replace(
        gateway_settings, response_retention_days=2, run_usage_flusher=False
    )
    async with AsyncTestClient(create_app(settings)):
        deadline = time.monotonic() + 10
        while await _kept(db_sessionmaker) != {"resp_recent"}:
            assert time.monotonic() < deadline, "the gateway did not prune"
            await asyncio.sleep(0.05)


def test_thirty_days_unless_the_environment_says_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert Settings.from_env().response_retention_days == 30
    monkeypatch.setenv("SLUICEGATE_RESPONSE_RETENTION_DAYS", "7")
    assert Settings.from_env().response_retention_days == 7

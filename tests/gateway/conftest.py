"""Gateway fixtures shared by tests/gateway/*: a migrated database, settings, clients.

Each test module gets its own migrated database (emptied before every test) and each test its
own usage stream name, so suites can run side by side on one PostgreSQL and one Redis.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
from redis.asyncio import Redis
from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine

from gateway.db.migrate import upgrade
from gateway.db.session import create_engine, create_sessionmaker
from gateway.settings import Settings


async def _execute(database_url: str, *statements: str) -> None:
    engine = create_async_engine(database_url, isolation_level="AUTOCOMMIT")
    try:
        async with engine.connect() as connection:
            for statement in statements:
                await connection.execute(text(statement))
    finally:
        await engine.dispose()


@pytest.fixture(scope="module")
def gateway_database_url(admin_database_url: str) -> Iterator[str]:
    """One migrated database per test module: creating one costs about a second here."""
    name = f"sg_gw_{uuid.uuid4().hex[:12]}"
    asyncio.run(_execute(admin_database_url, f'CREATE DATABASE "{name}"'))
    url = make_url(admin_database_url).set(database=name).render_as_string(hide_password=False)
    upgrade(url)
    yield url
    asyncio.run(_execute(admin_database_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def migrated_database_url(gateway_database_url: str) -> str:
    """The module's migrated database, emptied for this test."""
    asyncio.run(
        _execute(
            gateway_database_url,
            "SET lock_timeout = '10s'",
            "TRUNCATE api_keys, usage_records, usage_daily",
        )
    )
    return gateway_database_url


@pytest.fixture
def gateway_settings(migrated_database_url: str, redis_url: str, unique_name: str) -> Settings:
    return Settings.from_env(
        database_url=migrated_database_url,
        redis_url=redis_url,
        master_key=f"sg-master-{unique_name}",
        usage_stream=f"sg:usage:test:{unique_name}",
        usage_flush_interval_s=0.05,
    )


@pytest.fixture
async def redis_client(gateway_settings: Settings) -> AsyncIterator[Redis]:
    client = Redis.from_url(gateway_settings.redis_url)
    yield client
    await client.delete(gateway_settings.usage_stream)
    await client.aclose()


@pytest.fixture
async def db_sessionmaker(
    gateway_settings: Settings,
) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    engine = create_engine(gateway_settings.database_url)
    yield create_sessionmaker(engine)
    await engine.dispose()

"""Gateway fixtures shared by tests/gateway/*: a migrated database, settings, clients.

Each test gets its own database and its own usage stream name, so suites can run side by
side on one PostgreSQL and one Redis.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.db.migrate import upgrade
from gateway.db.session import create_engine, create_sessionmaker
from gateway.settings import Settings


@pytest.fixture
def migrated_database_url(fresh_database_url: str) -> str:
    upgrade(fresh_database_url)
    return fresh_database_url


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

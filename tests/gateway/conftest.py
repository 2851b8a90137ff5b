"""Gateway fixtures shared by tests/gateway/*: a migrated database, settings, clients.

Each test module gets its own migrated database (emptied before every test) and each test its
own usage stream name, so suites can run side by side on one PostgreSQL and one Redis.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest
from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluicegate.gateway.db.scratch import execute_autocommit, scratch_database
from sluicegate.gateway.db.session import create_engine, create_sessionmaker
from sluicegate.gateway.settings import Settings


@pytest.fixture(scope="module")
def gateway_database_url(admin_database_url: str) -> Iterator[str]:
    """One migrated database per test module: creating one costs about a second here."""
    with scratch_database(admin_database_url, prefix="sg_gw") as url:
        yield url


@pytest.fixture
def migrated_database_url(gateway_database_url: str) -> str:
    """The module's migrated database, emptied for this test."""
    asyncio.run(
        execute_autocommit(
            gateway_database_url,
            "SET lock_timeout = '10s'",
            "TRUNCATE lora_adapters, api_keys, teams, model_prices, audit_log, usage_records, usage_daily",
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

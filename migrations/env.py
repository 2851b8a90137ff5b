"""Alembic environment: runs migrations over an async (asyncpg) connection.

The URL is ``sqlalchemy.url`` when the caller set one (``sluicegate.gateway.db.migrate`` does), else
``SLUICEGATE_DATABASE_URL`` through the gateway settings.
"""

from __future__ import annotations

import asyncio

from alembic import context
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from sluicegate.gateway.db.models import metadata
from sluicegate.gateway.settings import Settings

config = context.config


def _database_url() -> str:
    return config.get_main_option("sqlalchemy.url") or Settings.from_env().database_url


def _run(connection: Connection) -> None:
    context.configure(connection=connection, target_metadata=metadata, compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


async def _run_online() -> None:
    engine = create_async_engine(_database_url())
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_run)
    finally:
        await engine.dispose()


if context.is_offline_mode():
    context.configure(url=_database_url(), target_metadata=metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    asyncio.run(_run_online())

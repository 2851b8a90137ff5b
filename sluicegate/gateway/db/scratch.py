"""Throwaway databases for tests and benchmarks.

Each gets a unique name on the server of an admin URL (one allowed to create databases) and is
dropped on exit, its open connections with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator

from sqlalchemy import text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import create_async_engine

from sluicegate.gateway.db.migrate import upgrade
from sluicegate.gateway.settings import asyncpg_database_url


async def execute_autocommit(database_url: str, *statements: str) -> None:
    """Run statements outside a transaction (CREATE/DROP DATABASE refuse to run inside one)."""
    engine = create_async_engine(asyncpg_database_url(database_url), isolation_level="AUTOCOMMIT")
    try:
        async with engine.connect() as connection:
            for statement in statements:
                await connection.execute(text(statement))
    finally:
        await engine.dispose()


@contextlib.contextmanager
def scratch_database(
    admin_url: str, *, prefix: str = "sg_scratch", migrate: bool = True
) -> Iterator[str]:
    """The URL of a new database, migrated to head unless ``migrate`` is false."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    asyncio.run(execute_autocommit(admin_url, f'CREATE DATABASE "{name}"'))
    try:
        url = make_url(admin_url).set(database=name).render_as_string(hide_password=False)
        if migrate:
            upgrade(url)
        yield url
    finally:
        asyncio.run(execute_autocommit(admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))

"""The async engine and session factory every DB user in the gateway shares."""

from __future__ import annotations

from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker
from sqlalchemy.ext.asyncio import create_async_engine as _create_async_engine

from sluicegate.gateway.settings import asyncpg_database_url

CONNECT_TIMEOUT_S = 5.0
"""asyncpg waits 60 s by default; an unreachable database should fail fast and be retried."""


def create_engine(database_url: str, *, pool_size: int = 5) -> AsyncEngine:
    # pre_ping lets the flusher and admin routes recover by themselves after a database
    # restart; the request path never takes a connection once a key is cached.
    return _create_async_engine(
        asyncpg_database_url(database_url),
        pool_size=pool_size,
        pool_pre_ping=True,
        connect_args={"timeout": CONNECT_TIMEOUT_S},
    )


def create_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)

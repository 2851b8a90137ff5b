"""The database URL in the forms PostgreSQL tools print: ``postgresql://`` and ``postgres://``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from sqlalchemy import text

from sluicegate.gateway.db.session import create_engine
from sluicegate.gateway.settings import Settings, asyncpg_database_url


def _plain(url: str, scheme: str) -> str:
    assert url.startswith("postgresql+asyncpg://")
    return scheme + "://" + url.removeprefix("postgresql+asyncpg://")


@pytest.mark.parametrize("scheme", ["postgresql", "postgres"])
async def test_settings_and_engine_take_libpq_urls(admin_database_url: str, scheme: str) -> None:
    settings = Settings.from_env(database_url=_plain(admin_database_url, scheme))
    assert settings.database_url.startswith("postgresql+asyncpg://")
    engine = create_engine(_plain(admin_database_url, scheme))
    try:
        async with engine.connect() as connection:
            assert (await connection.execute(text("SELECT 1"))).scalar() == 1
    finally:
        await engine.dispose()


def test_migrate_command_takes_a_postgres_url(fresh_database_url: str) -> None:
    env = {"SLUICEGATE_DATABASE_URL": _plain(fresh_database_url, "postgres")}
    done = subprocess.run(
        [sys.executable, "-m", "sluicegate.gateway.cli", "migrate"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr


def test_sslmode_becomes_asyncpg_ssl_and_other_urls_pass_through() -> None:
    assert (
        asyncpg_database_url("postgresql://u:p@db:5432/app?sslmode=require")
        == "postgresql+asyncpg://u:p@db:5432/app?ssl=require"
    )
    kept = "postgresql+asyncpg://u@/app?host=/run/postgresql"
    assert asyncpg_database_url(kept) == kept
    assert (
        asyncpg_database_url("postgres://u@/app?host=/tmp")
        == "postgresql+asyncpg://u@/app?host=/tmp"
    )

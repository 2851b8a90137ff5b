"""Alembic: upgrade head, downgrade base, upgrade head again, on a real PostgreSQL."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Connection, inspect

from sluicegate.gateway.db.migrate import downgrade, upgrade
from sluicegate.gateway.db.models import metadata
from sluicegate.gateway.db.session import create_engine

TABLES = {
    "api_keys",
    "usage_records",
    "usage_daily",
    "teams",
    "model_prices",
    "audit_log",
}


def _inspect_sync(connection: Connection) -> tuple[set[str], list[object]]:
    tables = set(inspect(connection).get_table_names()) - {"alembic_version"}
    diff = compare_metadata(MigrationContext.configure(connection), metadata) if tables else []
    return tables, diff


def _schema(url: str) -> tuple[set[str], list[object]]:
    async def run() -> tuple[set[str], list[object]]:
        engine = create_engine(url)
        try:
            async with engine.connect() as connection:
                return await connection.run_sync(_inspect_sync)
        finally:
            await engine.dispose()

    return asyncio.run(run())


def test_upgrade_downgrade_upgrade(fresh_database_url: str) -> None:
    upgrade(fresh_database_url)
    tables, diff = _schema(fresh_database_url)
    assert tables == TABLES
    assert diff == [], "the migration and the models disagree"

    downgrade(fresh_database_url)
    assert _schema(fresh_database_url)[0] == set()

    upgrade(fresh_database_url)
    tables, diff = _schema(fresh_database_url)
    assert tables == TABLES
    assert diff == []


def test_sluicegate_migrate_works_from_any_directory(
    fresh_database_url: str, tmp_path: Path
) -> None:
    env = {**os.environ, "SLUICEGATE_DATABASE_URL": fresh_database_url}
    result = subprocess.run(
        [sys.executable, "-m", "sluicegate.gateway.cli", "migrate"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert _schema(fresh_database_url)[0] == TABLES


def test_sluicegate_migrate_reports_an_unreachable_database() -> None:
    from sluicegate.gateway.db.migrate import main

    assert main(["--database-url", "postgresql+asyncpg://postgres@127.0.0.1:1/none"]) == 1

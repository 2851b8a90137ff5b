"""Alembic: upgrade head, downgrade base, upgrade head again, on a real PostgreSQL."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Connection, inspect, text

from sluicegate.gateway.db.migrate import downgrade, upgrade
from sluicegate.gateway.db.models import metadata
from sluicegate.gateway.db.session import create_engine, create_sessionmaker
from sluicegate.gateway.db.usage_upkeep import fold_usage_rollups

DERIVED_ROLLUPS = {
    "usage_daily_keys",
    "usage_daily_models",
    "usage_daily_totals",
    "usage_monthly",
    "usage_monthly_keys",
}
TABLES = {
    "api_keys",
    "usage_records",
    "usage_daily",
    "teams",
    "model_prices",
    "audit_log",
    "usage_rollup_changes",
    "stored_responses",
    "lora_adapters",
    *DERIVED_ROLLUPS,
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


def fold(url: str) -> int:
    async def run() -> int:
        engine = create_engine(url)
        try:
            async with create_sessionmaker(engine)() as session, session.begin():
                return await fold_usage_rollups(session)
        finally:
            await engine.dispose()

    return asyncio.run(run())


def _execute(url: str, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
    """One statement (``params`` a list: once per item), committed; its rows, if any."""

    async def run() -> list[tuple[Any, ...]]:
        engine = create_engine(url)
        try:
            async with engine.begin() as connection:
                result = await connection.execute(text(sql), params or {})
                return [tuple(row) for row in result] if result.returns_rows else []
        finally:
            await engine.dispose()

    return asyncio.run(run())


_INSERT_DAILY = (
    "INSERT INTO usage_daily (day, key_id, model, requests, prompt_tokens, completion_tokens, "
    "cost_micros, errors, team_id) VALUES (:day, :key, :model, :r, :p, :c, :m, :e, :team)"
)
_DAILY_FIELDS = ("day", "key", "model", "r", "p", "c", "m", "e", "team")


def test_0003_fills_the_derived_rollups_from_usage_daily_and_downgrades(
    fresh_database_url: str,
) -> None:
    """An upgrade of a database with usage: the rollups start equal to usage_daily grouped,
    and the triggers take over from there; the downgrade gives back 0002's indexes."""
    url = fresh_database_url
    upgrade(url, "0002")
    team, key_a, key_b = (uuid.uuid4() for _ in range(3))
    day = dt.date.fromisoformat
    rows = [
        (day("2026-03-31"), key_a, "m1", 2, 10, 5, 7, 1, team),
        (day("2026-04-01"), key_a, "m1", 1, 3, 3, 0, 0, team),
        (day("2026-04-01"), key_b, "m2", 4, 40, 0, 9, 0, None),
        (day("2026-04-02"), key_b, "m1", 1, 1, 1, 1, 1, None),
    ]
    _execute(url, _INSERT_DAILY, [dict(zip(_DAILY_FIELDS, row, strict=True)) for row in rows])
    upgrade(url)

    march, april = dt.date(2026, 3, 1), dt.date(2026, 4, 1)
    assert _execute(
        url,
        "SELECT month, key_id, model, requests, prompt_tokens, source_rows "
        "FROM usage_monthly ORDER BY 1, 2, 3",
    ) == sorted(
        [
            (march, key_a, "m1", 2, 10, 1),
            (april, key_a, "m1", 1, 3, 1),
            (april, key_b, "m1", 1, 1, 1),
            (april, key_b, "m2", 4, 40, 1),
        ]
    )
    assert _execute(
        url, "SELECT model, day::text, requests, errors FROM usage_daily_totals ORDER BY 1, 2"
    ) == [
        ("m1", "2026-03-31", 2, 1),
        ("m1", "2026-04-01", 1, 0),
        ("m1", "2026-04-02", 1, 1),
        ("m2", "2026-04-01", 4, 0),
    ]
    no_team = "00000000-0000-0000-0000-000000000000"
    assert sorted(
        _execute(url, "SELECT day::text, team_id::text, requests FROM usage_daily_keys")
    ) == sorted(
        [
            ("2026-03-31", str(team), 2),
            ("2026-04-01", str(team), 1),
            ("2026-04-01", no_team, 4),
            ("2026-04-02", no_team, 1),
        ]
    )
    assert _execute(url, "SELECT count(*) FROM usage_rollup_changes") == [(0,)]
    # From here on the triggers record each change, and a fold adds it: another April day of
    # key a adds to its month.
    later = (day("2026-04-03"), key_a, "m2", 5, 1, 1, 1, 0, team)
    _execute(url, _INSERT_DAILY, dict(zip(_DAILY_FIELDS, later, strict=True)))
    assert _execute(url, "SELECT requests, source_rows FROM usage_rollup_changes") == [(5, 1)]
    assert fold(url) == 1
    assert _execute(
        url,
        "SELECT requests FROM usage_monthly_keys WHERE key_id = :key AND month = '2026-04-01'",
        {"key": key_a},
    ) == [(6,)]

    downgrade(url, "0002")
    assert _schema(url)[0] == TABLES - DERIVED_ROLLUPS - {
        "usage_rollup_changes",
        "stored_responses",
        "lora_adapters",
    }
    indexes = _execute(url, "SELECT indexname FROM pg_indexes WHERE tablename = 'usage_records'")
    assert {name for (name,) in indexes} == {
        "pk_usage_records",
        "ix_usage_records_finished",
        "ix_usage_records_key_finished",
        "ix_usage_records_model_finished",
        "ix_usage_records_team_finished",
    }

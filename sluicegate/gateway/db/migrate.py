"""``sluicegate migrate``: bring the database schema to the newest Alembic revision.

The Alembic scripts live in ``migrations/`` at the repository root; ``sluicegate/gateway/db/migrations``
links to them so they ship inside the wheel and are found beside this module whether the
package was installed from a checkout, editable, or as a plain wheel.
Alembic's env runs its own event loop: from async code, call ``upgrade_async``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from alembic import command
from alembic.config import Config

from sluicegate.gateway.settings import Settings, asyncpg_database_url

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"


def alembic_config(database_url: str) -> Config:
    if not (MIGRATIONS_DIR / "env.py").is_file():
        raise FileNotFoundError(
            f"Alembic scripts not found at {MIGRATIONS_DIR}; reinstall sluicegate"
        )
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # ConfigParser interpolation would read a '%' in a password as a placeholder.
    url = asyncpg_database_url(database_url)
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def upgrade(database_url: str, revision: str = "head") -> None:
    command.upgrade(alembic_config(database_url), revision)


def downgrade(database_url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(database_url), revision)


async def upgrade_async(database_url: str, revision: str = "head") -> None:
    await asyncio.to_thread(upgrade, database_url, revision)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="sluicegate migrate",
        description="Upgrade the database (SLUICEGATE_DATABASE_URL) to the newest schema.",
    )
    parser.add_argument("--database-url", help="overrides SLUICEGATE_DATABASE_URL")
    parser.add_argument("--revision", default="head", help="target revision (default: head)")
    args = parser.parse_args(argv)
    url = args.database_url or Settings.from_env().database_url
    try:
        upgrade(url, args.revision)
    except Exception as exc:
        print(f"sluicegate migrate: {exc}", file=sys.stderr)
        return 1
    print(f"database schema at {args.revision}")
    return 0

"""Upkeep of the usage tables: folding pending changes into the derived rollups, and
deleting usage records past their retention."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from sluicegate.gateway.db.models import NO_TEAM
from sluicegate.gateway.db.usage import aware
from sluicegate.gateway.db.usage_sources import SUMMED

# Folding: the pending changes into the derived rollups, in one statement that deletes them
# and adds them up per rollup key. Each rollup's key in its primary key's order, as an
# expression of usage_daily's columns (the changes have the same); migration 0003 has a copy.
_TEAM_KEY = f"coalesce(team_id, '{NO_TEAM}'::uuid)"
_MONTH_KEY = "date_trunc('month', day)::date"
_ROLLUP_KEYS: dict[str, tuple[tuple[str, str], ...]] = {
    "usage_daily_keys": (("day", "day"), ("team_id", _TEAM_KEY), ("key_id", "key_id")),
    "usage_daily_models": (("team_id", _TEAM_KEY), ("model", "model"), ("day", "day")),
    "usage_daily_totals": (("model", "model"), ("day", "day")),
    "usage_monthly": (
        ("model", "model"),
        ("month", _MONTH_KEY),
        ("team_id", _TEAM_KEY),
        ("key_id", "key_id"),
    ),
    "usage_monthly_keys": (("month", _MONTH_KEY), ("team_id", _TEAM_KEY), ("key_id", "key_id")),
}
_CHANGED = (*SUMMED, "source_rows")


def _fold_into(table: str) -> str:
    keys = _ROLLUP_KEYS[table]
    names = ", ".join(name for name, _ in keys)
    positions = ", ".join(str(i + 1) for i in range(len(keys)))
    added = ", ".join(f"{c} = {table}.{c} + excluded.{c}" for c in _CHANGED)
    # Sorted, and one fold at a time (FOLD_LOCK): the rollup rows' locks are taken in order.
    return (
        f"{table}_folded AS (INSERT INTO {table} ({names}, {', '.join(_CHANGED)}) "
        f"SELECT {', '.join(expr for _, expr in keys)}, "
        + ", ".join(f"sum({c})" for c in _CHANGED)
        + f" FROM moved GROUP BY {positions} HAVING "
        + " OR ".join(f"sum({c}) <> 0" for c in _CHANGED)
        + f" ORDER BY {positions} ON CONFLICT ({names}) DO UPDATE SET {added})"
    )


_FOLD = text(
    "WITH moved AS (DELETE FROM usage_rollup_changes WHERE id IN (SELECT id FROM "
    "usage_rollup_changes ORDER BY id LIMIT :limit) RETURNING day, key_id, model, team_id, "
    f"{', '.join(_CHANGED)}), "
    + ", ".join(_fold_into(table) for table in _ROLLUP_KEYS)
    + " SELECT count(*), count(*) FILTER (WHERE source_rows < 0) FROM moved"
)
_DROP_EMPTIED = [text(f"DELETE FROM {table} WHERE source_rows = 0") for table in _ROLLUP_KEYS]
# Per database (the table's oid): folds on several replicas would only queue on the same rows.
_FOLD_LOCK = text(
    "SELECT pg_try_advisory_xact_lock(CAST(CAST(CAST('usage_rollup_changes' AS regclass) "
    "AS oid) AS bigint))"
)
FOLD_LIMIT = 50_000
"""Pending changes one fold moves: a hundred full batches' worth, a few hundred ms."""


async def fold_usage_rollups(session: AsyncSession, limit: int = FOLD_LIMIT) -> int:
    """Adds up to ``limit`` of the oldest pending changes to the derived rollups, in the
    caller's transaction; returns how many it moved, 0 when another session is folding."""
    if not (await session.execute(_FOLD_LOCK)).scalar():
        return 0
    moved, removing = (await session.execute(_FOLD, {"limit": limit})).one()
    if removing:
        # Rows moved to another team or deleted from usage_daily (rare): the groups they left
        # may sum no row now. A scan of each rollup, in the background fold only.
        for statement in _DROP_EMPTIED:
            await session.execute(statement)
    return int(moved)


# Oldest first through ix_usage_records_finished, and by ctid (a TID scan): each batch costs
# its own rows, however many records are kept. SKIP LOCKED: pruners on several replicas split
# the backlog instead of queueing on one another's rows.
_DELETE_EXPIRED = text(
    "DELETE FROM usage_records WHERE ctid = ANY(ARRAY("
    "SELECT ctid FROM usage_records WHERE finished_at < :cutoff "
    "ORDER BY finished_at LIMIT :limit FOR UPDATE SKIP LOCKED))"
)


async def delete_usage_records_before(
    session: AsyncSession, cutoff: dt.datetime, limit: int
) -> int:
    """Deletes up to ``limit`` of the oldest usage records finished before ``cutoff``; returns
    how many. The rollups keep every total: they are written with the records, never derived
    from usage_records afterwards, so every report and budget reads the same after."""
    result = await session.execute(_DELETE_EXPIRED, {"cutoff": aware(cutoff), "limit": limit})
    return int(result.rowcount)  # type: ignore[attr-defined]

"""Which rollup tables answer a usage report, as the rows the report sums."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Callable
from typing import Any, Literal

from sqlalchemy import (
    BigInteger,
    ColumnElement,
    Select,
    Subquery,
    Table,
    cast,
    false,
    func,
    literal,
    select,
    union_all,
)

from sluicegate.gateway.db.models import (
    NO_TEAM,
    UsageDaily,
    UsageDailyKey,
    UsageDailyModel,
    UsageDailyTotal,
    UsageMonthly,
    UsageMonthlyKey,
    UsageRollupChange,
)

GroupBy = Literal["day", "model", "key", "team"]


# Which rollup answers which report. usage_daily holds a row per day, key and model (7.3M at
# 1,000 keys x 10 models x 730 days); the rollups derived from it (models.py) hold the same
# sums over coarser keys, less the changes not yet folded into them, which every report reads
# beside them (usage_rollup_changes: a few batches' worth). Each report reads the smallest
# rollup that still has its filters and its grouping, so none reads more than tens of
# thousands of rows at that size:
#   a key filter                      -> usage_daily by (key_id, day): <= models x days rows
#   by key or by team, with a model   -> usage_monthly for whole months, and for the days of a
#                                        partly covered month at either end of the range
#                                        usage_daily (by key) or usage_daily_models (by team)
#   by key or by team, no model       -> usage_monthly_keys, and usage_daily_keys for those days
#   a team filter                     -> usage_daily_models: <= models x days rows per team
#   anything else (every key)         -> usage_daily_totals: <= models x days rows
DAILY = UsageDaily.__table__
DAILY_KEYS = UsageDailyKey.__table__
DAILY_MODELS = UsageDailyModel.__table__
DAILY_TOTALS = UsageDailyTotal.__table__
MONTHLY = UsageMonthly.__table__
MONTHLY_KEYS = UsageMonthlyKey.__table__
PENDING = UsageRollupChange.__table__
SUMMED = ("requests", "prompt_tokens", "completion_tokens", "cost_micros", "errors")


def matching(
    table: Table,
    *,
    key_id: uuid.UUID | None = None,
    team_id: uuid.UUID | None = None,
    model: str | None = None,
) -> list[ColumnElement[bool]]:
    columns = table.c
    conditions: list[ColumnElement[bool]] = []
    if team_id is not None:
        # The derived rollups file keys in no team under NO_TEAM, which no team has: asked for
        # by id, it matches nothing, as in usage_daily.
        conditions.append(false() if team_id == NO_TEAM else columns.team_id == team_id)
    if key_id is not None:
        conditions.append(columns.key_id == key_id)
    if model is not None:
        conditions.append(columns.model == model)
    return conditions


def between(
    column: ColumnElement[dt.date], first: dt.date | None, last: dt.date | None
) -> list[ColumnElement[bool]]:
    bounds: list[ColumnElement[bool]] = []
    if first is not None:
        bounds.append(column >= first)
    if last is not None:
        bounds.append(column <= last)
    return bounds


def _add_months(day: dt.date, months: int) -> dt.date:
    index = day.year * 12 + day.month - 1 + months
    return dt.date(index // 12, index % 12 + 1, 1)


def _whole_months(
    since: dt.date | None, until: dt.date | None
) -> tuple[dt.date | None, dt.date | None] | None:
    """The first and last months (their first days) wholly inside ``since..until``, None for an
    open end; None when no month is."""
    first = since if since is None or since.day == 1 else _add_months(since, 1)
    last = None if until is None else _add_months(until + dt.timedelta(days=1), -1)
    if first is not None and last is not None and first > last:
        return None
    return first, last


def summed(column: ColumnElement[Any]) -> ColumnElement[int]:
    """A column's sum, 0 over no rows. As bigint: PostgreSQL's sum of bigints is a numeric,
    which arrives as a Decimal; decoding those took 7 of a 1,000-row report's 24 ms."""
    return cast(func.coalesce(func.sum(column), 0), BigInteger)


def source_rows_of(table: Table) -> ColumnElement[Any]:
    """How many usage_daily rows a row sums (a pending change: how many it adds or removes)."""
    if table is DAILY:
        return literal(1, BigInteger).label("source_rows")
    return table.c.source_rows


def _team_column(table: Table) -> ColumnElement[Any]:
    if table is DAILY or table is PENDING:
        return table.c.team_id
    return func.nullif(table.c.team_id, NO_TEAM)


_GROUPED = {
    "day": lambda table: table.c.day,
    "model": lambda table: table.c.model,
    "key": lambda table: table.c.key_id,
    "team": _team_column,
}


def _rollups(
    key_id: uuid.UUID | None,
    team_id: uuid.UUID | None,
    model: str | None,
    group_by: GroupBy | None,
) -> tuple[Table, Table | None]:
    """The day rollup that answers a report, and the month rollup that answers it for whole
    months (None: the day rollup alone is small enough)."""
    if key_id is not None:
        return DAILY, None
    if group_by in ("key", "team") and model is not None:
        return (DAILY if group_by == "key" else DAILY_MODELS), MONTHLY
    if group_by in ("key", "team"):
        return DAILY_KEYS, MONTHLY_KEYS
    if team_id is not None:
        return DAILY_MODELS, None
    return DAILY_TOTALS, None


def day_rollup(key_id: uuid.UUID | None, team_id: uuid.UUID | None) -> Table:
    """The smallest per-day rollup that can filter by ``key_id`` and ``team_id``."""
    if key_id is not None:
        return DAILY
    return DAILY_MODELS if team_id is not None else DAILY_TOTALS


def with_pending(
    parts: list[Select], tables: set[Table], rows: Callable[[Table], Select]
) -> Subquery:
    """The parts, and the pending changes when a derived rollup is among their tables: those
    are usage_daily's grain, so the caller's ``rows`` selects them like usage_daily."""
    if tables - {DAILY}:
        parts = [*parts, rows(PENDING)]
    return union_all(*parts).subquery() if len(parts) > 1 else parts[0].subquery()


def report_rows(
    *,
    key_id: uuid.UUID | None,
    team_id: uuid.UUID | None,
    model: str | None,
    since: dt.date | None,
    until: dt.date | None,
    group_by: GroupBy | None,
) -> Subquery:
    """The rows a report sums (its group as ``grouped``, the sums, ``source_rows``), as a
    subquery: one rollup's rows in range, or whole months from a month rollup and the days
    around them; and the pending changes in range."""
    day_table, month_table = _rollups(key_id, team_id, model, group_by)
    filters = {"key_id": key_id, "team_id": team_id, "model": model}

    def rows(table: Table, bucket: str, first: dt.date | None, last: dt.date | None) -> Select:
        grouped = [_GROUPED[group_by](table).label("grouped")] if group_by else []
        days = between(table.c[bucket], first, last)
        by_model = table is DAILY and model is not None and key_id is None
        if by_model and first is not None and last is not None:
            # Day by day: each (day, model) is one range of the primary key. As a range of
            # days, every model's entries of those days are read and most dropped (260k of
            # them for 26k rows in a month of the bench: 38 ms against 18).
            span = (last - first).days + 1
            days = [table.c.day.in_([first + dt.timedelta(days=i) for i in range(span)])]
        return select(*grouped, *(table.c[name] for name in SUMMED), source_rows_of(table)).where(
            *matching(table, **filters), *days
        )

    def pending(table: Table) -> Select:
        return rows(table, "day", since, until)

    months = None if month_table is None else _whole_months(since, until)
    if month_table is None or months is None:
        return with_pending([rows(day_table, "day", since, until)], {day_table}, pending)
    first, last = months
    parts = [rows(month_table, "month", first, last)]
    if since is not None and first is not None and since < first:
        parts.append(rows(day_table, "day", since, first - dt.timedelta(days=1)))
    if until is not None and last is not None and until >= _add_months(last, 1):
        parts.append(rows(day_table, "day", _add_months(last, 1), until))
    if day_table is not DAILY:
        return with_pending(parts, {day_table, month_table}, pending)
    # The days around the months come from usage_daily itself: the pending changes count
    # only within the months.
    end = None if last is None else _add_months(last, 1) - dt.timedelta(days=1)
    parts.append(rows(PENDING, "day", first, end))
    return union_all(*parts).subquery()

"""The admin and UI usage reports, and the budgets' committed spend, from the rollups
(``usage_sources`` picks which)."""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Row, Select, Table, TextClause, func, select, text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluicegate.gateway.db.models import NO_TEAM
from sluicegate.gateway.db.usage_sources import (
    DAILY,
    SUMMED,
    GroupBy,
    between,
    day_rollup,
    matching,
    report_rows,
    source_rows_of,
    summed,
    with_pending,
)


@dataclass(frozen=True, slots=True)
class UsageTotals:
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cost_micros: int = 0
    errors: int = 0
    group: str | None = None
    """The day (ISO), model, key id or team id this row totals, when grouped."""

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "cost_micros": self.cost_micros,
            "errors": self.errors,
        }


async def usage_totals(
    session: AsyncSession,
    *,
    key_id: uuid.UUID | None = None,
    model: str | None = None,
    since: dt.date | None = None,
    until: dt.date | None = None,
    group_by: GroupBy | None = None,
    team_id: uuid.UUID | None = None,
) -> list[UsageTotals]:
    """Totals from the rollups over UTC days ``since..until`` (both inclusive).

    Without ``group_by`` the result is one row (zeros when nothing matched).
    """
    rows = report_rows(
        key_id=key_id, team_id=team_id, model=model, since=since, until=until, group_by=group_by
    )
    sums = [summed(rows.c[name]) for name in SUMMED]
    if group_by is None:
        row = (await session.execute(select(*sums))).one()
        return [UsageTotals(*(int(value) for value in row))]
    query = (
        select(rows.c.grouped, *sums)
        .group_by(rows.c.grouped)
        # A group whose rows all moved away (a team's, when its key moved) while the change
        # is still pending sums no usage_daily row: usage_daily has no such group.
        .having(func.sum(rows.c.source_rows) > 0)
        .order_by(rows.c.grouped)
    )
    return [
        UsageTotals(*(int(value) for value in values), group=_group_label(group))
        for group, *values in (await session.execute(query)).all()
    ]


async def daily_by_model(
    session: AsyncSession,
    *,
    since: dt.date,
    until: dt.date | None = None,
    team_id: uuid.UUID | None = None,
    key_id: uuid.UUID | None = None,
    model: str | None = None,
) -> list[tuple[dt.date, str, int, int]]:
    """``(day, model, tokens, cost micros)`` rows for charts, oldest first."""
    table = day_rollup(key_id, team_id)

    def rows(source: Table) -> Select:
        columns = source.c
        return select(
            columns.day,
            columns.model,
            (columns.prompt_tokens + columns.completion_tokens).label("tokens"),
            columns.cost_micros,
            source_rows_of(source),
        ).where(
            *matching(source, key_id=key_id, team_id=team_id, model=model),
            *between(columns.day, since, until),
        )

    found = with_pending([rows(table)], {table}, rows)
    query = (
        select(found.c.day, found.c.model, summed(found.c.tokens), summed(found.c.cost_micros))
        .group_by(found.c.day, found.c.model)
        .having(func.sum(found.c.source_rows) > 0)
        .order_by(found.c.day, found.c.model)
    )
    return [
        (day, name, int(tokens), int(cost))
        for day, name, tokens, cost in (await session.execute(query)).all()
    ]


def _group_label(value: object) -> str:
    return value.isoformat() if isinstance(value, dt.date) else str(value)


def budget_period_start(period: str | None, now: dt.datetime) -> dt.date | None:
    """First UTC day of the budget period containing ``now``; None for a lifetime budget."""
    today = now.astimezone(dt.UTC).date()
    if period == "day":
        return today
    if period == "month":
        return today.replace(day=1)
    return None


async def tokens_used_since(session: AsyncSession, key_id: uuid.UUID, since: dt.date | None) -> int:
    return (await spent_since(session, key_id=key_id, since=since))[0]


async def spent_since(
    session: AsyncSession,
    *,
    key_id: uuid.UUID | None = None,
    team_id: uuid.UUID | None = None,
    since: dt.date | None,
) -> tuple[int, int]:
    """``(tokens, cost micros)`` committed for a key or a team since a UTC day (None: ever)."""
    table = day_rollup(key_id, team_id)

    def rows(source: Table) -> Select:
        columns = source.c
        return select(
            (columns.prompt_tokens + columns.completion_tokens).label("tokens"),
            columns.cost_micros,
        ).where(
            *matching(source, key_id=key_id, team_id=team_id),
            *between(columns.day, since, None),
        )

    found = with_pending([rows(table)], {table}, rows)
    query = select(summed(found.c.tokens), summed(found.c.cost_micros))
    tokens, micros = (await session.execute(query)).one()
    return int(tokens), int(micros)


class DatabaseSpend:
    """The limiter's ``SpendSource``: a budget period's committed usage, from the rollups."""

    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession]) -> None:
        self._sessionmaker = sessionmaker
        self._pending: dict[tuple[str, str, dt.date | None], asyncio.Future[tuple[int, int]]] = {}

    async def spent(self, kind: str, scope_id: str, period: str | None) -> tuple[int, int]:
        # One query per scope however many requests find its counters missing at once (a
        # busy key at midnight, or every key after a FLUSHALL).
        since = budget_period_start(period, dt.datetime.now(dt.UTC))
        flight = (kind, scope_id, since)
        future = self._pending.get(flight)
        if future is None:
            future = asyncio.ensure_future(self._query(kind, uuid.UUID(scope_id), since))
            self._pending[flight] = future
            future.add_done_callback(lambda _: self._pending.pop(flight, None))
        return await asyncio.shield(future)

    async def _query(self, kind: str, scope: uuid.UUID, since: dt.date | None) -> tuple[int, int]:
        async with self._sessionmaker() as session:
            if kind == "team":
                return await spent_since(session, team_id=scope, since=since)
            return await spent_since(session, key_id=scope, since=since)


async def daily_rows(
    session: AsyncSession,
    *,
    since: dt.date | None = None,
    until: dt.date | None = None,
    team_id: uuid.UUID | None = None,
    key_id: uuid.UUID | None = None,
    model: str | None = None,
) -> list[Row[Any]]:
    """The rollup rows themselves (day, key, model; usage_daily's columns by name), oldest
    first: for CSV exports. Plain rows, not ORM objects: the export of a month of 1,000 keys
    (300k rows) would spend most of its time building and tracking those."""
    query = (
        select(*DAILY.c)
        .where(
            *matching(DAILY, key_id=key_id, team_id=team_id, model=model),
            *between(DAILY.c.day, since, until),
        )
        .order_by(DAILY.c.day, DAILY.c.model, DAILY.c.key_id)
    )
    return list((await session.execute(query)).all())


def _models_used(rollup: str, team: str) -> TextClause:
    """The models of a rollup whose key starts with the model (after the team), by a skip scan
    of that key: one index probe per model in use, where SELECT DISTINCT would read every row
    of every day. Then the pending changes' models; and a model with a pending change that
    takes rows away must still sum some (a team's last key of a model moved to another team)."""
    return text(
        "WITH RECURSIVE used(model) AS ("
        f"(SELECT model FROM {rollup} WHERE {team} ORDER BY model LIMIT 1) UNION ALL "
        f"SELECT (SELECT r.model FROM {rollup} r WHERE {team} AND r.model > used.model "
        "ORDER BY r.model LIMIT 1) FROM used WHERE used.model IS NOT NULL), "
        "candidates(model) AS (SELECT model FROM used WHERE model IS NOT NULL UNION "
        f"SELECT model FROM usage_rollup_changes WHERE {team}) "
        "SELECT c.model FROM candidates c WHERE NOT EXISTS (SELECT 1 FROM usage_rollup_changes "
        f"WHERE {team} AND model = c.model AND source_rows < 0) OR "
        f"(SELECT coalesce(sum(source_rows), 0) FROM {rollup} WHERE {team} AND model = c.model) "
        "+ (SELECT coalesce(sum(source_rows), 0) FROM usage_rollup_changes "
        f"WHERE {team} AND model = c.model) > 0 ORDER BY c.model"
    )


_MODELS_USED = _models_used("usage_daily_totals", "TRUE")
_TEAM_MODELS_USED = _models_used("usage_daily_models", "team_id = :team")


async def models_used(session: AsyncSession, team_id: uuid.UUID | None = None) -> list[str]:
    """The models with any usage (of one team's keys), in order."""
    if team_id is None:
        return list((await session.execute(_MODELS_USED)).scalars())
    if team_id == NO_TEAM:
        return []
    return list((await session.execute(_TEAM_MODELS_USED, {"team": team_id})).scalars())

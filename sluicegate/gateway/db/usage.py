"""Usage in PostgreSQL: the flusher's idempotent batch write, and the admin usage queries.

``insert_usage`` inserts records with ``ON CONFLICT (request_id) DO NOTHING`` and adds to the
daily rollups only the rows that statement actually inserted (``RETURNING``), in the same
transaction: replaying a batch, or two flushers racing on one, never counts a request twice.
A request recorded twice with different counts (a lease reaper billed what it knew of a
replica it took for dead; the replica was alive and settled the whole request after) keeps
the larger counts, and the rollups take the difference.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy import ColumnElement, func, select, text, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluicegate.gateway.db.models import UsageDaily, UsageRecord

GroupBy = Literal["day", "model", "key", "team"]


_COUNTED = (
    UsageRecord.request_id,
    UsageRecord.key_id,
    UsageRecord.model,
    UsageRecord.finished_at,
    UsageRecord.prompt_tokens,
    UsageRecord.completion_tokens,
    UsageRecord.cost_micros,
    UsageRecord.status,
)
"""What the rollups read of a stored usage record."""


_RECORD_COLUMNS = (
    ("request_id", "text"),
    ("key_id", "uuid"),
    ("model", "text"),
    ("deployment", "text"),
    ("prompt_tokens", "integer"),
    ("completion_tokens", "integer"),
    ("cached_tokens", "integer"),
    ("cost_micros", "bigint"),
    ("team_id", "uuid"),
    ("status", "text"),
    ("finish_reason", "text"),
    ("latency_ms", "double precision"),
    ("ttft_ms", "double precision"),
    ("started_at", "timestamptz"),
    ("finished_at", "timestamptz"),
)
_ROLLUP_COLUMNS = (
    ("day", "date"),
    ("key_id", "uuid"),
    ("model", "text"),
    ("requests", "bigint"),
    ("prompt_tokens", "bigint"),
    ("completion_tokens", "bigint"),
    ("cost_micros", "bigint"),
    ("errors", "bigint"),
    ("team_id", "uuid"),
)


def _unnest(columns: tuple[tuple[str, str], ...]) -> str:
    """``SELECT`` of one row per array element, one array parameter per column."""
    arrays = ", ".join(f"CAST(:{name} AS {kind}[])" for name, kind in columns)
    return f"SELECT * FROM unnest({arrays})"


# Rows go as one array per column (unnest): asyncpg encodes each array in C, and the statement
# is the same whatever the batch size, so it is prepared once per connection. The ORM's
# executemany of the same rows cost ~50 µs of CPU per row and ~6 ms per batch, all of it on
# the gateway's event loop.
_INSERT_RECORDS = text(
    f"INSERT INTO usage_records ({', '.join(name for name, _ in _RECORD_COLUMNS)}) "
    f"{_unnest(_RECORD_COLUMNS)} ON CONFLICT (request_id) DO NOTHING "
    f"RETURNING {', '.join(column.key for column in _COUNTED)}, team_id"
).columns(*(UsageRecord.__table__.c[column.key] for column in _COUNTED), UsageRecord.team_id)
_ADDED = ("requests", "prompt_tokens", "completion_tokens", "cost_micros", "errors")
_UPSERT_ROLLUPS = text(
    f"INSERT INTO usage_daily ({', '.join(name for name, _ in _ROLLUP_COLUMNS)}) "
    f"{_unnest(_ROLLUP_COLUMNS)} ON CONFLICT (day, key_id, model) DO UPDATE SET "
    + ", ".join(f"{name} = usage_daily.{name} + excluded.{name}" for name in _ADDED)
    + ", team_id = coalesce(excluded.team_id, usage_daily.team_id)"
)


def _aware(moment: dt.datetime) -> dt.datetime:
    if moment.tzinfo is None:
        raise TypeError(f"usage record time without a time zone: {moment!r}")
    return moment


async def insert_usage(session: AsyncSession, rows: Sequence[dict[str, Any]]) -> int:
    """Inserts usage rows (UsageRecord column names) not seen before; returns how many."""
    if not rows:
        return 0
    # One row per request: the larger of a batch's records of it (see bills_more).
    unique: dict[str, dict[str, Any]] = {}
    for row in rows:
        full = {"cached_tokens": 0, "cost_micros": 0, "team_id": None, **row}
        seen = unique.get(full["request_id"])
        unique[full["request_id"]] = full if seen is None or bills_more(full, seen) else seen
    full_rows = list(unique.values())
    arrays = {name: [row.get(name) for row in full_rows] for name, _ in _RECORD_COLUMNS}
    for name in ("started_at", "finished_at"):
        arrays[name] = [_aware(moment) for moment in arrays[name]]
    inserted = (await session.execute(_INSERT_RECORDS, arrays)).all()
    totals: dict[tuple[dt.date, uuid.UUID, str], list[Any]] = defaultdict(
        lambda: [0, 0, 0, 0, 0, None]
    )
    fresh = set()
    for request_id, key_id, model, finished_at, prompt, completion, cost, status, team in inserted:
        fresh.add(request_id)
        total = totals[(finished_at.astimezone(dt.UTC).date(), key_id, model)]
        total[0] += 1
        total[1] += prompt
        total[2] += completion
        total[3] += cost
        total[4] += status == "error"
        total[5] = team
    stored = [row for row in full_rows if row["request_id"] not in fresh]
    if stored:
        await _raise_counts(session, stored, totals)
    if totals:
        # Sorted: two flushers upsert the same rollup rows in one order (no deadlock).
        ordered = [(*key, *total) for key, total in sorted(totals.items())]
        rollups = {name: [row[i] for row in ordered] for i, (name, _) in enumerate(_ROLLUP_COLUMNS)}
        await session.execute(_UPSERT_ROLLUPS, rollups)
    return len(inserted)


def bills_more(row: dict[str, Any], than: dict[str, Any]) -> bool:
    """Whether a record of a request bills more than another of it (ties: the later)."""
    return (row["prompt_tokens"] + row["completion_tokens"], row["cost_micros"]) >= (
        than["prompt_tokens"] + than["completion_tokens"],
        than["cost_micros"],
    )


async def _raise_counts(
    session: AsyncSession,
    rows: list[dict[str, Any]],
    totals: dict[tuple[dt.date, uuid.UUID, str], list[Any]],
) -> None:
    """Records of requests stored already: a replayed batch (the same counts: nothing to do),
    or the serving replica's record of a request a reaper billed in part. The stored row takes
    the larger counts (and the serving replica's status and timings with them); the rollup of
    the row's day takes the difference, as a correction of a request already counted."""
    ids = [row["request_id"] for row in rows]
    # FOR UPDATE: two flushers correcting one request apply one difference after the other.
    current = {
        found.request_id: found
        for found in await session.execute(
            select(*_COUNTED).where(UsageRecord.request_id.in_(ids)).with_for_update()
        )
    }
    for row in rows:
        old = current.get(row["request_id"])
        if old is None:
            continue
        prompt = max(old.prompt_tokens, row["prompt_tokens"])
        completion = max(old.completion_tokens, row["completion_tokens"])
        cost = max(old.cost_micros, row["cost_micros"])
        if (prompt, completion, cost) == (
            old.prompt_tokens,
            old.completion_tokens,
            old.cost_micros,
        ):
            continue
        changes: dict[str, Any] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "cost_micros": cost,
        }
        status = old.status
        if row["prompt_tokens"] + row["completion_tokens"] >= (
            old.prompt_tokens + old.completion_tokens
        ):
            status = row["status"]
            for name in ("status", "finish_reason", "latency_ms", "ttft_ms", "deployment"):
                if name in row:
                    changes[name] = row[name]
            changes["cached_tokens"] = row["cached_tokens"]
        await session.execute(
            update(UsageRecord).where(UsageRecord.request_id == row["request_id"]).values(**changes)
        )
        total = totals[(old.finished_at.astimezone(dt.UTC).date(), old.key_id, old.model)]
        total[1] += prompt - old.prompt_tokens
        total[2] += completion - old.completion_tokens
        total[3] += cost - old.cost_micros
        total[4] += (status == "error") - (old.status == "error")
        total[5] = total[5] or row["team_id"]


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


def _filters(
    key_id: uuid.UUID | None,
    model: str | None,
    since: dt.date | None,
    until: dt.date | None,
    team_id: uuid.UUID | None = None,
) -> list[ColumnElement[bool]]:
    conditions: list[ColumnElement[bool]] = []
    if team_id is not None:
        conditions.append(UsageDaily.team_id == team_id)
    if key_id is not None:
        conditions.append(UsageDaily.key_id == key_id)
    if model is not None:
        conditions.append(UsageDaily.model == model)
    if since is not None:
        conditions.append(UsageDaily.day >= since)
    if until is not None:
        conditions.append(UsageDaily.day <= until)
    return conditions


_GROUP_COLUMNS = {
    "day": UsageDaily.day,
    "model": UsageDaily.model,
    "key": UsageDaily.key_id,
    "team": UsageDaily.team_id,
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
    """Totals from the daily rollups over UTC days ``since..until`` (both inclusive).

    Without ``group_by`` the result is one row (zeros when nothing matched).
    """
    sums = (
        func.coalesce(func.sum(UsageDaily.requests), 0),
        func.coalesce(func.sum(UsageDaily.prompt_tokens), 0),
        func.coalesce(func.sum(UsageDaily.completion_tokens), 0),
        func.coalesce(func.sum(UsageDaily.cost_micros), 0),
        func.coalesce(func.sum(UsageDaily.errors), 0),
    )
    conditions = _filters(key_id, model, since, until, team_id)
    if group_by is None:
        row = (await session.execute(select(*sums).where(*conditions))).one()
        return [UsageTotals(*(int(value) for value in row))]
    column = _GROUP_COLUMNS[group_by]
    query = select(column, *sums).where(*conditions).group_by(column).order_by(column)
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
    query = (
        select(
            UsageDaily.day,
            UsageDaily.model,
            func.sum(UsageDaily.prompt_tokens + UsageDaily.completion_tokens),
            func.sum(UsageDaily.cost_micros),
        )
        .where(*_filters(key_id, model, since, until, team_id))
        .group_by(UsageDaily.day, UsageDaily.model)
        .order_by(UsageDaily.day, UsageDaily.model)
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
    query = select(
        func.coalesce(func.sum(UsageDaily.prompt_tokens + UsageDaily.completion_tokens), 0),
        func.coalesce(func.sum(UsageDaily.cost_micros), 0),
    ).where(*_filters(key_id, None, since, None, team_id))
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
) -> list[UsageDaily]:
    """The rollup rows themselves (day, key, model), oldest first: for CSV exports."""
    query = (
        select(UsageDaily)
        .where(*_filters(key_id, model, since, until, team_id))
        .order_by(UsageDaily.day, UsageDaily.model, UsageDaily.key_id)
    )
    return list((await session.execute(query)).scalars())


async def models_used(session: AsyncSession, team_id: uuid.UUID | None = None) -> list[str]:
    query = select(UsageDaily.model).distinct().order_by(UsageDaily.model)
    if team_id is not None:
        query = query.where(UsageDaily.team_id == team_id)
    return list((await session.execute(query)).scalars())

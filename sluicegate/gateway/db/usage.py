"""Usage in PostgreSQL: the flusher's idempotent batch write.

``insert_usage`` inserts records with ``ON CONFLICT (request_id) DO NOTHING`` and adds to the
daily rollups only the rows that statement actually inserted (``RETURNING``), in the same
transaction: replaying a batch, or two flushers racing on one, never counts a request twice.
A request recorded twice with different counts (a lease reaper billed what it knew of a
replica it took for dead; the replica was alive and settled the whole request after) keeps
the larger counts, and the rollups take the difference.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from sqlalchemy import select, text, update
from sqlalchemy.ext.asyncio import AsyncSession

from sluicegate.gateway.db.models import UsageRecord

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
    ("adapter", "text"),
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


def aware(moment: dt.datetime) -> dt.datetime:
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
        arrays[name] = [aware(moment) for moment in arrays[name]]
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

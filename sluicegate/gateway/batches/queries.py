"""Queries of files and batches as their owner sees them, and the creation and cancellation of
batches.

Every read is scoped to an owner, as stored Responses are: a key in a team sees its team's
files and batches, a key in no team only its own; anything else is answered as if it did not
exist. The runner's claims and settlements are in ``claims.py``.
"""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, delete, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from sluicegate.gateway.db.batch_tables import Batch, BatchFile, BatchLine

ACTIVE = ("validating", "in_progress")
ENDED = ("completed", "failed", "expired", "cancelled")


@dataclass(frozen=True, slots=True)
class Owner:
    """Who asks: the key, and its team when it has one."""

    key_id: uuid.UUID
    team_id: uuid.UUID | None

    @classmethod
    def of(cls, key_id: str, team_id: str | None) -> Owner:
        return cls(uuid.UUID(key_id), uuid.UUID(team_id) if team_id else None)

    def sees(self, table: type[Batch] | type[BatchFile]) -> ColumnElement[bool]:
        if self.team_id is not None:
            return table.team_id == self.team_id
        return (table.team_id.is_(None)) & (table.key_id == self.key_id)


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


async def insert_file(session: AsyncSession, row: BatchFile) -> None:
    session.add(row)
    await session.flush()


async def select_file(session: AsyncSession, owner: Owner, file_id: str) -> BatchFile | None:
    query = select(BatchFile).where(BatchFile.id == file_id, owner.sees(BatchFile))
    return (await session.execute(query)).scalar()


async def select_files(
    session: AsyncSession,
    owner: Owner,
    *,
    purpose: str | None,
    limit: int,
    after: str | None,
    newest_first: bool,
) -> list[BatchFile]:
    query = select(BatchFile).where(owner.sees(BatchFile))
    if purpose is not None:
        query = query.where(BatchFile.purpose == purpose)
    order = (BatchFile.created_at, BatchFile.id)
    if after is not None:
        cursor = select(BatchFile.created_at, BatchFile.id).where(BatchFile.id == after)
        found = (await session.execute(cursor)).first()
        if found is not None:
            key = (BatchFile.created_at, BatchFile.id)
            query = query.where(
                _before(key, tuple(found)) if newest_first else _after(key, tuple(found))
            )
    query = query.order_by(*(c.desc() for c in order) if newest_first else order).limit(limit)
    return list((await session.execute(query)).scalars())


def _before(columns: tuple[Any, Any], values: tuple[Any, ...]) -> ColumnElement[bool]:
    return (columns[0] < values[0]) | ((columns[0] == values[0]) & (columns[1] < values[1]))


def _after(columns: tuple[Any, Any], values: tuple[Any, ...]) -> ColumnElement[bool]:
    return (columns[0] > values[0]) | ((columns[0] == values[0]) & (columns[1] > values[1]))


async def delete_file(session: AsyncSession, owner: Owner, file_id: str) -> BatchFile | None:
    found = await select_file(session, owner, file_id)
    if found is not None:
        await session.execute(delete(BatchFile).where(BatchFile.id == file_id))
    return found


async def insert_batch(
    session: AsyncSession, batch: Batch, lines: list[tuple[str, dict[str, Any]]]
) -> None:
    session.add(batch)
    await session.flush()
    rows = [
        {
            "batch_id": batch.id,
            "line": number,
            "custom_id": custom_id,
            "body": body,
            "state": "pending",
            "attempts": 0,
            "prompt_tokens": 0,
            "completion_tokens": 0,
        }
        for number, (custom_id, body) in enumerate(lines)
    ]
    for start in range(0, len(rows), 1000):
        await session.execute(insert(BatchLine), rows[start : start + 1000])


async def select_batch(
    session: AsyncSession, owner: Owner, batch_id: str, api: str
) -> Batch | None:
    query = select(Batch).where(Batch.id == batch_id, Batch.api == api, owner.sees(Batch))
    return (await session.execute(query)).scalar()


async def select_batches(
    session: AsyncSession, owner: Owner, api: str, *, limit: int, after: str | None
) -> list[Batch]:
    """Newest first; ``after`` a batch id: the ones older than it."""
    query = select(Batch).where(Batch.api == api, owner.sees(Batch))
    if after is not None:
        cursor = select(Batch.created_at, Batch.id).where(Batch.id == after)
        found = (await session.execute(cursor)).first()
        if found is not None:
            query = query.where(_before((Batch.created_at, Batch.id), tuple(found)))
    query = query.order_by(Batch.created_at.desc(), Batch.id.desc()).limit(limit)
    return list((await session.execute(query)).scalars())


async def cancel_batch(session: AsyncSession, batch: Batch) -> None:
    """Lines not yet started are skipped now; the runner ends the batch once the lines already
    running have settled."""
    if batch.status not in ACTIVE:
        return
    now = utcnow()
    await session.execute(
        update(Batch).where(Batch.id == batch.id).values(status="cancelling", cancelling_at=now)
    )
    await session.execute(
        update(BatchLine)
        .where(BatchLine.batch_id == batch.id, BatchLine.state == "pending")
        .values(state="skipped")
    )
    batch.status, batch.cancelling_at = "cancelling", now


async def delete_batch(session: AsyncSession, batch: Batch) -> None:
    await session.execute(delete(BatchLine).where(BatchLine.batch_id == batch.id))
    await session.execute(delete(Batch).where(Batch.id == batch.id))


async def select_lines(session: AsyncSession, batch_id: str) -> list[BatchLine]:
    query = select(BatchLine).where(BatchLine.batch_id == batch_id).order_by(BatchLine.line)
    return list((await session.execute(query)).scalars())


async def admin_batches(
    session: AsyncSession,
    *,
    key_id: uuid.UUID | None,
    team_id: uuid.UUID | None,
    status: str | None,
    limit: int,
    offset: int,
) -> list[Batch]:
    """Batches of both APIs for the admin API and the UI, newest first."""
    query = select(Batch)
    if key_id is not None:
        query = query.where(Batch.key_id == key_id)
    if team_id is not None:
        query = query.where(Batch.team_id == team_id)
    if status is not None:
        query = query.where(Batch.status == status)
    query = query.order_by(Batch.created_at.desc(), Batch.id.desc()).limit(limit).offset(offset)
    return list((await session.execute(query)).scalars())

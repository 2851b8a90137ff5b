"""Queries of stored Responses: keep one, read or delete one as its owner, prune the expired.

Every read and delete is scoped to an owner: a key in a team sees its team's responses, a key
in no team only its own. A response outside that scope is answered as if it did not exist.
"""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, delete, insert, select, text
from sqlalchemy.ext.asyncio import AsyncSession

from sluicegate.gateway.db.models import StoredResponse


@dataclass(frozen=True, slots=True)
class Owner:
    """Who asks: the key, and its team when it has one."""

    key_id: uuid.UUID
    team_id: uuid.UUID | None

    def sees(self) -> ColumnElement[bool]:
        if self.team_id is not None:
            return StoredResponse.team_id == self.team_id
        return (StoredResponse.team_id.is_(None)) & (StoredResponse.key_id == self.key_id)


async def insert_response(
    session: AsyncSession,
    owner: Owner,
    response: dict[str, Any],
    input_items: list[dict[str, Any]],
    created_at: dt.datetime,
) -> None:
    await session.execute(
        insert(StoredResponse).values(
            id=response["id"],
            key_id=owner.key_id,
            team_id=owner.team_id,
            created_at=created_at,
            response=response,
            input_items=input_items,
        )
    )


async def select_response(
    session: AsyncSession, owner: Owner, response_id: str
) -> dict[str, Any] | None:
    """The response object; None when the owner sees no such response."""
    query = select(StoredResponse.response).where(StoredResponse.id == response_id, owner.sees())
    return (await session.execute(query)).scalar()


async def select_items(
    session: AsyncSession, owner: Owner, response_id: str
) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    """The response object and its input items; None when the owner sees no such response."""
    query = select(StoredResponse.response, StoredResponse.input_items).where(
        StoredResponse.id == response_id, owner.sees()
    )
    row = (await session.execute(query)).first()
    return None if row is None else (row[0], row[1])


async def delete_response(session: AsyncSession, owner: Owner, response_id: str) -> bool:
    result = await session.execute(
        delete(StoredResponse).where(StoredResponse.id == response_id, owner.sees())
    )
    return bool(result.rowcount)  # type: ignore[attr-defined]


# As usage retention's: oldest first through ix_stored_responses_created, each batch its own
# rows by ctid; SKIP LOCKED lets pruners on several replicas split the backlog.
_DELETE_EXPIRED = text(
    "DELETE FROM stored_responses WHERE ctid = ANY(ARRAY("
    "SELECT ctid FROM stored_responses WHERE created_at < :cutoff "
    "ORDER BY created_at LIMIT :limit FOR UPDATE SKIP LOCKED))"
)


async def delete_responses_before(session: AsyncSession, cutoff: dt.datetime, limit: int) -> int:
    """Deletes up to ``limit`` of the oldest responses created before ``cutoff``; how many."""
    if cutoff.tzinfo is None:
        raise TypeError(f"retention cutoff without a time zone: {cutoff!r}")
    result = await session.execute(_DELETE_EXPIRED, {"cutoff": cutoff, "limit": limit})
    return int(result.rowcount)  # type: ignore[attr-defined]

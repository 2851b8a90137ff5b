"""The audit log: one row per admin mutation, written in the mutation's own transaction."""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec
from sqlalchemy import ColumnElement, select
from sqlalchemy.ext.asyncio import AsyncSession

from sluicegate.gateway.db.keys import utcnow
from sluicegate.gateway.db.models import AuditEntry


@dataclass(frozen=True, slots=True)
class Actor:
    """Who made a change: the master key, or a team admin's key."""

    key_id: uuid.UUID | None = None
    team_id: uuid.UUID | None = None
    name: str | None = None
    """Set for a trusted tool with database access (``cli``) instead of a key."""

    @property
    def is_master(self) -> bool:
        return self.key_id is None

    @property
    def label(self) -> str:
        if self.name is not None:
            return self.name
        return "master" if self.key_id is None else f"key:{self.key_id}"


def _json(value: Any) -> dict[str, Any] | None:
    return None if value is None else msgspec.to_builtins(value)  # type: ignore[no-any-return]


async def record(
    session: AsyncSession,
    actor: Actor,
    action: str,
    *,
    target_type: str,
    target_id: str,
    team_id: uuid.UUID | None = None,
    before: Any = None,
    after: Any = None,
    request_id: str | None = None,
) -> None:
    """Adds the entry to the session's transaction: it commits or rolls back with the change."""
    session.add(
        AuditEntry(
            at=utcnow(),
            actor=actor.label,
            actor_key_id=actor.key_id,
            action=action,
            target_type=target_type,
            target_id=target_id,
            team_id=team_id,
            before=_json(before),
            after=_json(after),
            request_id=request_id,
        )
    )
    await session.flush()


def _filters(
    *,
    actor: str | None,
    action: str | None,
    target_type: str | None,
    target_id: str | None,
    team_id: uuid.UUID | None,
    since: dt.datetime | None,
    until: dt.datetime | None,
) -> list[ColumnElement[bool]]:
    conditions: list[ColumnElement[bool]] = []
    if actor is not None:
        conditions.append(AuditEntry.actor == actor)
    if action is not None:
        conditions.append(AuditEntry.action == action)
    if target_type is not None:
        conditions.append(AuditEntry.target_type == target_type)
    if target_id is not None:
        conditions.append(AuditEntry.target_id == target_id)
    if team_id is not None:
        conditions.append(AuditEntry.team_id == team_id)
    if since is not None:
        conditions.append(AuditEntry.at >= since)
    if until is not None:
        conditions.append(AuditEntry.at < until)
    return conditions


async def list_entries(
    session: AsyncSession,
    *,
    limit: int = 100,
    offset: int = 0,
    actor: str | None = None,
    action: str | None = None,
    target_type: str | None = None,
    target_id: str | None = None,
    team_id: uuid.UUID | None = None,
    since: dt.datetime | None = None,
    until: dt.datetime | None = None,
) -> list[AuditEntry]:
    """Newest first."""
    conditions = _filters(
        actor=actor,
        action=action,
        target_type=target_type,
        target_id=target_id,
        team_id=team_id,
        since=since,
        until=until,
    )
    query = (
        select(AuditEntry)
        .where(*conditions)
        .order_by(AuditEntry.at.desc(), AuditEntry.id.desc())
        .limit(limit)
        .offset(offset)
    )
    return list((await session.execute(query)).scalars())

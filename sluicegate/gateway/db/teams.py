"""The queries behind team management (admin API and UI)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from sluicegate.gateway.db.keys import utcnow
from sluicegate.gateway.db.models import ApiKey, Team

UPDATABLE_FIELDS = frozenset(
    {
        "name",
        "allowed_models",
        "rpm_limit",
        "tpm_limit",
        "max_parallel_requests",
        "token_budget",
        "max_budget_micros",
        "budget_period",
        "team_metadata",
    }
)


async def create_team(session: AsyncSession, fields: Mapping[str, Any]) -> Team:
    unknown = set(fields) - UPDATABLE_FIELDS
    if unknown:
        raise ValueError(f"unknown team fields {sorted(unknown)}")
    team = Team(**{"allowed_models": [], "team_metadata": {}, **fields})
    session.add(team)
    await session.flush()
    return team


async def get_team(session: AsyncSession, team_id: uuid.UUID) -> Team | None:
    return await session.get(Team, team_id)


async def find_by_name(session: AsyncSession, name: str) -> Team | None:
    return (await session.execute(select(Team).where(Team.name == name))).scalar_one_or_none()


async def list_teams(session: AsyncSession, *, limit: int = 100, offset: int = 0) -> list[Team]:
    query = select(Team).order_by(Team.name, Team.id).limit(limit).offset(offset)
    return list((await session.execute(query)).scalars())


async def update_team(
    session: AsyncSession, team_id: uuid.UUID, changes: Mapping[str, Any]
) -> Team | None:
    unknown = set(changes) - UPDATABLE_FIELDS
    if unknown:
        raise ValueError(f"cannot update {sorted(unknown)}")
    team = await session.get(Team, team_id, with_for_update=True)
    if team is None:
        return None
    for name, value in changes.items():
        setattr(team, name, list(value) if name == "allowed_models" else value)
    team.updated_at = utcnow()
    await session.flush()
    return team


async def key_ids(session: AsyncSession, team_id: uuid.UUID) -> list[str]:
    query = select(ApiKey.id).where(ApiKey.team_id == team_id)
    return [str(key_id) for key_id in (await session.execute(query)).scalars()]


async def key_counts(session: AsyncSession) -> dict[uuid.UUID, int]:
    """Active (unrevoked) keys per team."""
    query = (
        select(ApiKey.team_id, func.count())
        .where(ApiKey.team_id.is_not(None), ApiKey.revoked_at.is_(None))
        .group_by(ApiKey.team_id)
    )
    return {team_id: int(count) for team_id, count in (await session.execute(query)).all()}

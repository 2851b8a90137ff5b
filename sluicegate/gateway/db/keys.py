"""The queries behind API-key management, shared by the admin routes and the keys CLI."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import ColumnElement, and_, func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from sluicegate.gateway.db.models import ApiKey, Team

UPDATABLE_FIELDS = frozenset(
    {
        "name",
        "allowed_models",
        "rpm_limit",
        "tpm_limit",
        "max_parallel_requests",
        "token_budget",
        "budget_period",
        "expires_at",
        "key_metadata",
        "team_id",
        "role",
        "max_budget_micros",
    }
)


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


async def create_key(
    session: AsyncSession,
    *,
    name: str,
    key_hash: str,
    key_prefix: str,
    allowed_models: Sequence[str] = (),
    rpm_limit: int | None = None,
    tpm_limit: int | None = None,
    max_parallel_requests: int | None = None,
    token_budget: int | None = None,
    budget_period: str | None = None,
    expires_at: dt.datetime | None = None,
    key_metadata: Mapping[str, Any] | None = None,
    team_id: uuid.UUID | None = None,
    role: str = "member",
    max_budget_micros: int | None = None,
) -> ApiKey:
    key = ApiKey(
        team_id=team_id,
        role=role,
        max_budget_micros=max_budget_micros,
        name=name,
        key_hash=key_hash,
        key_prefix=key_prefix,
        allowed_models=list(allowed_models),
        rpm_limit=rpm_limit,
        tpm_limit=tpm_limit,
        max_parallel_requests=max_parallel_requests,
        token_budget=token_budget,
        budget_period=budget_period,
        expires_at=expires_at,
        key_metadata=dict(key_metadata or {}),
    )
    session.add(key)
    await session.flush()
    return key


async def get_key(session: AsyncSession, key_id: uuid.UUID) -> ApiKey | None:
    return await session.get(ApiKey, key_id)


async def find_by_hash(session: AsyncSession, key_hash: str) -> tuple[ApiKey, Team | None] | None:
    """The key (and its team) whose secret hashes to ``key_hash``: its current secret, or the
    one a rotation replaced while that one's grace period lasts."""
    query = (
        select(ApiKey, Team)
        .outerjoin(Team, ApiKey.team_id == Team.id)
        .where(
            or_(
                ApiKey.key_hash == key_hash,
                and_(
                    ApiKey.previous_key_hash == key_hash,
                    ApiKey.previous_key_expires_at > utcnow(),
                ),
            )
        )
    )
    row = (await session.execute(query)).first()
    return None if row is None else (row[0], row[1])


def _key_filters(
    include_revoked: bool, team_id: uuid.UUID | None, search: str | None
) -> list[ColumnElement[bool]]:
    conditions: list[ColumnElement[bool]] = []
    if not include_revoked:
        conditions.append(ApiKey.revoked_at.is_(None))
    if team_id is not None:
        conditions.append(ApiKey.team_id == team_id)
    if search:
        pattern = "%" + search.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"
        conditions.append(or_(ApiKey.name.ilike(pattern), ApiKey.key_prefix.ilike(pattern)))
    return conditions


async def list_keys(
    session: AsyncSession,
    *,
    include_revoked: bool = True,
    limit: int | None = 100,
    offset: int = 0,
    team_id: uuid.UUID | None = None,
    search: str | None = None,
) -> list[ApiKey]:
    query = select(ApiKey).order_by(ApiKey.created_at.desc(), ApiKey.id)
    query = query.where(*_key_filters(include_revoked, team_id, search))
    result = await session.execute(query.limit(limit).offset(offset))
    return list(result.scalars())


async def count_keys(
    session: AsyncSession,
    *,
    include_revoked: bool = True,
    team_id: uuid.UUID | None = None,
    search: str | None = None,
) -> int:
    query = select(func.count()).select_from(ApiKey)
    query = query.where(*_key_filters(include_revoked, team_id, search))
    return int((await session.execute(query)).scalar_one())


async def rotate_key(
    session: AsyncSession,
    key_id: uuid.UUID,
    *,
    key_hash: str,
    key_prefix: str,
    grace: dt.timedelta,
) -> ApiKey | None:
    """Gives the key a new secret; the old one keeps working for ``grace`` (none if zero)."""
    key = await session.get(ApiKey, key_id, with_for_update=True)
    if key is None:
        return None
    now = utcnow()
    key.previous_key_hash = key.key_hash if grace > dt.timedelta(0) else None
    key.previous_key_expires_at = now + grace if grace > dt.timedelta(0) else None
    key.key_hash = key_hash
    key.key_prefix = key_prefix
    key.updated_at = now
    await session.flush()
    return key


async def update_key(
    session: AsyncSession, key_id: uuid.UUID, changes: Mapping[str, Any]
) -> ApiKey | None:
    unknown = set(changes) - UPDATABLE_FIELDS
    if unknown:
        raise ValueError(f"cannot update {sorted(unknown)}")
    key = await session.get(ApiKey, key_id, with_for_update=True)
    if key is None:
        return None
    for name, value in changes.items():
        setattr(key, name, list(value) if name == "allowed_models" else value)
    key.updated_at = utcnow()
    await session.flush()
    return key


async def revoke_key(session: AsyncSession, key_id: uuid.UUID) -> ApiKey | None:
    """Marks the key revoked (idempotent: a second revoke keeps the first timestamp)."""
    key = await session.get(ApiKey, key_id, with_for_update=True)
    if key is None:
        return None
    if key.revoked_at is None:
        key.revoked_at = utcnow()
        key.updated_at = key.revoked_at
        await session.flush()
    return key

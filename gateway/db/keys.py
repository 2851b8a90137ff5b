"""The queries behind API-key management, shared by the admin routes and the keys CLI."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.db.models import ApiKey

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
) -> ApiKey:
    key = ApiKey(
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


async def find_by_hash(session: AsyncSession, key_hash: str) -> ApiKey | None:
    result = await session.execute(select(ApiKey).where(ApiKey.key_hash == key_hash))
    return result.scalar_one_or_none()


async def list_keys(
    session: AsyncSession,
    *,
    include_revoked: bool = True,
    limit: int | None = 100,
    offset: int = 0,
) -> list[ApiKey]:
    query = select(ApiKey).order_by(ApiKey.created_at.desc(), ApiKey.id)
    if not include_revoked:
        query = query.where(ApiKey.revoked_at.is_(None))
    result = await session.execute(query.limit(limit).offset(offset))
    return list(result.scalars())


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

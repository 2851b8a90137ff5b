"""Admin mutations, each with its audit row in the same transaction; shared by the admin API
and the web UI so both enforce the same rules.

Callers open the transaction (``async with sessionmaker() as s, s.begin()``) and, after it
commits, tell the replicas about changed keys (``publish_invalidation``).
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Mapping
from typing import Any

from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from sluicegate.gateway.api.admin.guards import ADMIN_DENIED, require_team_access
from sluicegate.gateway.api.admin.schemas import key_fields, price_fields, team_fields
from sluicegate.gateway.db import audit
from sluicegate.gateway.db import keys as key_queries
from sluicegate.gateway.db import prices as price_queries
from sluicegate.gateway.db import teams as team_queries
from sluicegate.gateway.db.audit import Actor
from sluicegate.gateway.db.models import ApiKey, ModelPrice, Team
from sluicegate.gateway.errors import Conflict, InvalidRequest, NotFound, PermissionDenied
from sluicegate.gateway.keys.records import generate_key
from sluicegate.gateway.usage.pricing import to_micros


def require_master(actor: Actor) -> None:
    if not actor.is_master:
        raise PermissionDenied("Only the master key may do this.", code=ADMIN_DENIED)


def parse_team_id(value: str | uuid.UUID | None) -> uuid.UUID | None:
    if value is None or isinstance(value, uuid.UUID):
        return value
    try:
        return uuid.UUID(value)
    except ValueError:
        raise InvalidRequest(f"'{value}' is not a team id.", param="team_id") from None


async def _existing_team(session: AsyncSession, team_id: uuid.UUID) -> Team:
    team = await team_queries.get_team(session, team_id)
    if team is None:
        raise NotFound(f"No team with id '{team_id}'.", param="team_id")
    return team


async def _audit_key(
    session: AsyncSession,
    actor: Actor,
    action: str,
    key: ApiKey,
    request_id: str | None,
    before: dict[str, Any] | None = None,
    **also: Any,
) -> None:
    """The audit row of a change to ``key``: its fields after (with ``also``), and before."""
    await audit.record(
        session,
        actor,
        action,
        target_type="key",
        target_id=str(key.id),
        team_id=key.team_id,
        before=before,
        after={**key_fields(key), **also},
        request_id=request_id,
    )


async def _audit_team(
    session: AsyncSession,
    actor: Actor,
    action: str,
    team: Team,
    request_id: str | None,
    before: dict[str, Any] | None = None,
    *,
    deleted: bool = False,
) -> None:
    """The audit row of a change to ``team``: its fields after (none once deleted), and before."""
    await audit.record(
        session,
        actor,
        action,
        target_type="team",
        target_id=str(team.id),
        team_id=team.id,
        before=before,
        after=None if deleted else team_fields(team),
        request_id=request_id,
    )


async def key_for(session: AsyncSession, actor: Actor, key_id: uuid.UUID) -> ApiKey:
    """The key, if this actor may see it (404 when missing, 403 when another team's)."""
    row = await key_queries.get_key(session, key_id)
    if row is None:
        raise NotFound(f"No API key with id '{key_id}'.", param="key_id")
    require_team_access(actor, row.team_id)
    return row


async def create_key(
    session: AsyncSession,
    actor: Actor,
    fields: Mapping[str, Any],
    team_id: str | uuid.UUID | None,
    request_id: str | None,
) -> tuple[ApiKey, str]:
    """Returns the key and its plaintext (to show once)."""
    team = parse_team_id(team_id)
    if not actor.is_master:
        if team is not None and team != actor.team_id:
            require_team_access(actor, team)
        if fields.get("role", "member") != "member":
            raise PermissionDenied("Only the master key may create team admin keys.", param="role")
        team = actor.team_id
    if team is not None:
        await _existing_team(session, team)
    elif fields.get("role") == "team_admin":
        raise InvalidRequest("A team admin key needs a team_id.", param="team_id")
    plaintext, key_hash, prefix = generate_key()
    row = await key_queries.create_key(
        session, key_hash=key_hash, key_prefix=prefix, team_id=team, **fields
    )
    await _audit_key(session, actor, "key.create", row, request_id)
    return row, plaintext


async def update_key(
    session: AsyncSession,
    actor: Actor,
    key_id: uuid.UUID,
    changes: dict[str, Any],
    request_id: str | None,
) -> ApiKey:
    row = await key_for(session, actor, key_id)
    if "team_id" in changes:
        changes["team_id"] = parse_team_id(changes["team_id"])
    if not actor.is_master:
        if "role" in changes and changes["role"] != row.role:
            raise PermissionDenied("Only the master key may change a key's role.", param="role")
        if "team_id" in changes and changes["team_id"] != row.team_id:
            raise PermissionDenied(
                "Only the master key may move keys between teams.", param="team_id"
            )
    if changes.get("team_id") is not None:
        await _existing_team(session, changes["team_id"])
    role = changes.get("role", row.role)
    team = changes.get("team_id", row.team_id)
    if role == "team_admin" and team is None:
        raise InvalidRequest("A team admin key needs a team_id.", param="team_id")
    before = key_fields(row)
    updated = await key_queries.update_key(session, key_id, changes)
    assert updated is not None
    await _audit_key(session, actor, "key.update", updated, request_id, before)
    return updated


async def revoke_key(
    session: AsyncSession, actor: Actor, key_id: uuid.UUID, request_id: str | None
) -> ApiKey:
    row = await key_for(session, actor, key_id)
    if row.revoked_at is not None:
        return row
    before = key_fields(row)
    revoked = await key_queries.revoke_key(session, key_id)
    assert revoked is not None
    await _audit_key(session, actor, "key.revoke", revoked, request_id, before)
    return revoked


async def rotate_key(
    session: AsyncSession,
    actor: Actor,
    key_id: uuid.UUID,
    grace_seconds: int,
    request_id: str | None,
) -> tuple[ApiKey, str]:
    row = await key_for(session, actor, key_id)
    if row.revoked_at is not None:
        raise InvalidRequest("A revoked key cannot be rotated.", param="key_id")
    before = key_fields(row)
    plaintext, key_hash, prefix = generate_key()
    rotated = await key_queries.rotate_key(
        session,
        key_id,
        key_hash=key_hash,
        key_prefix=prefix,
        grace=dt.timedelta(seconds=grace_seconds),
    )
    assert rotated is not None
    await _audit_key(
        session, actor, "key.rotate", rotated, request_id, before, grace_seconds=grace_seconds
    )
    return rotated, plaintext


async def create_team(
    session: AsyncSession, actor: Actor, fields: Mapping[str, Any], request_id: str | None
) -> Team:
    require_master(actor)
    if await team_queries.find_by_name(session, fields["name"]) is not None:
        raise Conflict(f"A team named '{fields['name']}' exists already.", param="name")
    team = await team_queries.create_team(session, fields)
    await _audit_team(session, actor, "team.create", team, request_id)
    return team


async def update_team(
    session: AsyncSession,
    actor: Actor,
    team_id: uuid.UUID,
    changes: Mapping[str, Any],
    request_id: str | None,
) -> tuple[Team, list[str]]:
    """Returns the team and the ids of its keys (their cached limits are stale now)."""
    require_master(actor)
    team = await _existing_team(session, team_id)
    if "name" in changes and changes["name"] != team.name:
        if await team_queries.find_by_name(session, changes["name"]) is not None:
            raise Conflict(f"A team named '{changes['name']}' exists already.", param="name")
    before = team_fields(team)
    updated = await team_queries.update_team(session, team_id, changes)
    assert updated is not None
    await _audit_team(session, actor, "team.update", updated, request_id, before)
    return updated, await team_queries.key_ids(session, team_id)


async def delete_team(
    session: AsyncSession, actor: Actor, team_id: uuid.UUID, request_id: str | None
) -> Team:
    require_master(actor)
    team = await _existing_team(session, team_id)
    keys = await team_queries.key_ids(session, team_id)
    if keys:
        raise Conflict(
            f"Team '{team.name}' still has {len(keys)} keys; move them to another team or "
            "delete them first.",
            param="team_id",
        )
    before = team_fields(team)
    await session.delete(team)
    try:
        await session.flush()
    except IntegrityError:
        raise Conflict("The team still has keys or LoRA adapters.", param="team_id") from None
    await _audit_team(session, actor, "team.delete", team, request_id, before, deleted=True)
    return team


async def add_price(
    session: AsyncSession,
    actor: Actor,
    *,
    model: str,
    input: float,
    output: float,
    cached_input: float | None,
    currency: str,
    effective_from: dt.datetime | None,
    request_id: str | None,
) -> ModelPrice:
    require_master(actor)
    try:
        row = await price_queries.add_price(
            session,
            model=model,
            input_micros=to_micros(input),
            cached_input_micros=to_micros(input if cached_input is None else cached_input),
            output_micros=to_micros(output),
            currency=currency,
            effective_from=effective_from,
        )
    except IntegrityError:
        raise Conflict(
            f"Model '{model}' already has a price effective from that moment.",
            param="effective_from",
        ) from None
    await audit.record(
        session,
        actor,
        "price.create",
        target_type="price",
        target_id=str(row.id),
        after=price_fields(row),
        request_id=request_id,
    )
    return row

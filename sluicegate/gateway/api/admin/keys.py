"""``/admin/keys``: create, list, read, update, rotate and revoke API keys.

The master key sees every key; a team admin sees and manages only its own team's keys.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Annotated, Any

from litestar import Controller, Request, delete, get, patch, post
from litestar.params import FromPath, FromQuery, JSONBody, Parameter
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluicegate.gateway.api.admin import service
from sluicegate.gateway.api.admin.guards import actor_of, admin_guard, request_id_of
from sluicegate.gateway.api.admin.reports import key_budget, usage_report
from sluicegate.gateway.api.admin.schemas import (
    CreatedKey,
    GroupBy,
    KeyCreate,
    KeyList,
    KeyUpdate,
    KeyUsageReport,
    KeyView,
    RotateRequest,
    key_fields,
)
from sluicegate.gateway.db import keys as key_queries
from sluicegate.gateway.db import teams as team_queries
from sluicegate.gateway.keys.cache import publish_invalidation


def sessions(request: Request[Any, Any, Any]) -> async_sessionmaker[AsyncSession]:
    return request.app.state.db_sessionmaker  # type: ignore[no-any-return]


class KeysController(Controller):
    path = "/admin/keys"
    guards = (admin_guard,)
    tags = ("admin",)

    @post("/", status_code=201)
    async def create_key(
        self, request: Request[Any, Any, Any], data: JSONBody[KeyCreate]
    ) -> CreatedKey:
        async with sessions(request)() as session, session.begin():
            row, plaintext = await service.create_key(
                session, actor_of(request), data.fields(), data.team_id, request_id_of(request)
            )
        return CreatedKey(**key_fields(row), key=plaintext)

    @get("/")
    async def list_keys(
        self,
        request: Request[Any, Any, Any],
        include_revoked: FromQuery[bool] = True,
        team_id: FromQuery[uuid.UUID | None] = None,
        search: FromQuery[str | None] = None,
        limit: Annotated[int, Parameter(ge=1, le=1000)] = 100,
        offset: Annotated[int, Parameter(ge=0, le=2**62)] = 0,
    ) -> KeyList:
        actor = actor_of(request)
        if not actor.is_master:
            service.require_team_access(actor, team_id or actor.team_id)
            team_id = actor.team_id
        filters = {"include_revoked": include_revoked, "team_id": team_id, "search": search}
        async with sessions(request)() as session:
            rows = await key_queries.list_keys(session, limit=limit, offset=offset, **filters)
            total = await key_queries.count_keys(session, **filters)
        return KeyList(data=[KeyView.of(row) for row in rows], total=total)

    @get("/{key_id:uuid}")
    async def get_key(
        self, request: Request[Any, Any, Any], key_id: FromPath[uuid.UUID]
    ) -> KeyView:
        async with sessions(request)() as session:
            row = await service.key_for(session, actor_of(request), key_id)
        return KeyView.of(row)

    @patch("/{key_id:uuid}")
    async def update_key(
        self,
        request: Request[Any, Any, Any],
        key_id: FromPath[uuid.UUID],
        data: JSONBody[KeyUpdate],
    ) -> KeyView:
        async with sessions(request)() as session, session.begin():
            row = await service.update_key(
                session, actor_of(request), key_id, data.changes(), request_id_of(request)
            )
        await publish_invalidation(request.app.state.redis, str(key_id))
        return KeyView.of(row)

    @delete("/{key_id:uuid}", status_code=200)
    async def revoke_key(
        self, request: Request[Any, Any, Any], key_id: FromPath[uuid.UUID]
    ) -> KeyView:
        async with sessions(request)() as session, session.begin():
            row = await service.revoke_key(
                session, actor_of(request), key_id, request_id_of(request)
            )
        await publish_invalidation(request.app.state.redis, str(key_id))
        return KeyView.of(row)

    @post("/{key_id:uuid}/rotate", status_code=200)
    async def rotate_key(
        self,
        request: Request[Any, Any, Any],
        key_id: FromPath[uuid.UUID],
        data: JSONBody[RotateRequest | None] = None,
    ) -> CreatedKey:
        """A new secret in ``key``; the old one works ``grace_seconds`` more, on every replica."""
        grace = data.grace_seconds if data is not None else 0
        async with sessions(request)() as session, session.begin():
            row, plaintext = await service.rotate_key(
                session, actor_of(request), key_id, grace, request_id_of(request)
            )
        await publish_invalidation(request.app.state.redis, str(key_id))
        return CreatedKey(**key_fields(row), key=plaintext)

    @get("/{key_id:uuid}/usage")
    async def key_usage(
        self,
        request: Request[Any, Any, Any],
        key_id: FromPath[uuid.UUID],
        model: FromQuery[str | None] = None,
        since: FromQuery[dt.date | None] = None,
        until: FromQuery[dt.date | None] = None,
        group_by: FromQuery[GroupBy | None] = None,
    ) -> KeyUsageReport:
        async with sessions(request)() as session:
            row = await service.key_for(session, actor_of(request), key_id)
            team = await team_queries.get_team(session, row.team_id) if row.team_id else None
            data, total = await usage_report(
                session, key_id=key_id, model=model, since=since, until=until, group_by=group_by
            )
        budget = await key_budget(request.app.state.limiter, row, team)
        return KeyUsageReport(
            group_by=group_by,
            data=data,
            total=total,
            currency=request.app.state.settings.currency,
            key_id=str(key_id),
            budget=budget,
        )

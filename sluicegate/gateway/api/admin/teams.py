"""``/admin/teams``: teams and their usage. Master key only, except that a team admin may
read its own team's usage."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Annotated, Any

from litestar import Controller, Request, delete, get, patch, post
from litestar.params import FromPath, FromQuery, JSONBody, Parameter

from sluicegate.gateway.api.admin import service
from sluicegate.gateway.api.admin.guards import (
    actor_of,
    admin_guard,
    master_guard,
    request_id_of,
    require_team_access,
)
from sluicegate.gateway.api.admin.keys import sessions
from sluicegate.gateway.api.admin.reports import team_budget, usage_report
from sluicegate.gateway.api.admin.schemas import (
    GroupBy,
    TeamCreate,
    TeamList,
    TeamUpdate,
    TeamUsageReport,
    TeamView,
)
from sluicegate.gateway.db import teams as team_queries
from sluicegate.gateway.errors import NotFound
from sluicegate.gateway.keys.cache import publish_invalidation


def _team_not_found(team_id: uuid.UUID) -> NotFound:
    return NotFound(f"No team with id '{team_id}'.", param="team_id")


class TeamsController(Controller):
    path = "/admin/teams"
    guards = (admin_guard,)
    tags = ("admin",)

    @post("/", status_code=201, guards=[master_guard])
    async def create_team(
        self, request: Request[Any, Any, Any], data: JSONBody[TeamCreate]
    ) -> TeamView:
        async with sessions(request)() as session, session.begin():
            team = await service.create_team(
                session, actor_of(request), data.fields(), request_id_of(request)
            )
        return TeamView.of(team)

    @get("/", guards=[master_guard])
    async def list_teams(
        self,
        request: Request[Any, Any, Any],
        limit: Annotated[int, Parameter(ge=1, le=1000)] = 100,
        offset: Annotated[int, Parameter(ge=0, le=2**62)] = 0,
    ) -> TeamList:
        async with sessions(request)() as session:
            rows = await team_queries.list_teams(session, limit=limit, offset=offset)
        return TeamList(data=[TeamView.of(row) for row in rows])

    @get("/{team_id:uuid}", guards=[master_guard])
    async def get_team(
        self, request: Request[Any, Any, Any], team_id: FromPath[uuid.UUID]
    ) -> TeamView:
        async with sessions(request)() as session:
            team = await team_queries.get_team(session, team_id)
        if team is None:
            raise _team_not_found(team_id)
        return TeamView.of(team)

    @patch("/{team_id:uuid}", guards=[master_guard])
    async def update_team(
        self,
        request: Request[Any, Any, Any],
        team_id: FromPath[uuid.UUID],
        data: JSONBody[TeamUpdate],
    ) -> TeamView:
        async with sessions(request)() as session, session.begin():
            team, key_ids = await service.update_team(
                session, actor_of(request), team_id, data.changes(), request_id_of(request)
            )
        # Every key of the team carries the team's limits in the key cache.
        await publish_invalidation(request.app.state.redis, *key_ids)
        return TeamView.of(team)

    @delete("/{team_id:uuid}", status_code=200, guards=[master_guard])
    async def delete_team(
        self, request: Request[Any, Any, Any], team_id: FromPath[uuid.UUID]
    ) -> TeamView:
        async with sessions(request)() as session, session.begin():
            team = await service.delete_team(
                session, actor_of(request), team_id, request_id_of(request)
            )
        return TeamView.of(team)

    @get("/{team_id:uuid}/usage")
    async def team_usage(
        self,
        request: Request[Any, Any, Any],
        team_id: FromPath[uuid.UUID],
        key_id: FromQuery[uuid.UUID | None] = None,
        model: FromQuery[str | None] = None,
        since: FromQuery[dt.date | None] = None,
        until: FromQuery[dt.date | None] = None,
        group_by: FromQuery[GroupBy | None] = None,
    ) -> TeamUsageReport:
        require_team_access(actor_of(request), team_id)
        async with sessions(request)() as session:
            team = await team_queries.get_team(session, team_id)
            if team is None:
                raise _team_not_found(team_id)
            data, total = await usage_report(
                session,
                team_id=team_id,
                key_id=key_id,
                model=model,
                since=since,
                until=until,
                group_by=group_by,
            )
        budget = await team_budget(request.app.state.limiter, team)
        return TeamUsageReport(
            group_by=group_by,
            data=data,
            total=total,
            currency=request.app.state.settings.currency,
            team_id=str(team_id),
            budget=budget,
        )

"""``/ui/teams``: teams with their keys, limits and budgets. The master key creates, edits and
deletes them; a team admin sees its own team only."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from litestar import Controller, Request, get, post
from litestar.params import FromPath, FromQuery
from litestar.response import Redirect, Template

from sluicegate.gateway.api.admin import service
from sluicegate.gateway.api.admin.guards import require_team_access
from sluicegate.gateway.api.admin.reports import team_budget
from sluicegate.gateway.db import teams as team_queries
from sluicegate.gateway.errors import NotFound
from sluicegate.gateway.keys.cache import publish_invalidation
from sluicegate.gateway.ui.common import FormError, render, request_id, sessions
from sluicegate.gateway.ui.limit_forms import (
    limit_fields_from_form,
    render_edit,
    render_refused_create,
)
from sluicegate.gateway.ui.session import check_csrf, session_of, ui_guard


async def _teams_context(request: Request[Any, Any, Any]) -> dict[str, Any]:
    session = session_of(request)
    async with sessions(request)() as db:
        if session.is_master:
            teams = await team_queries.list_teams(db, limit=1000)
        else:
            own = await team_queries.get_team(db, session.actor.team_id)  # type: ignore[arg-type]
            teams = [own] if own is not None else []
        counts = await team_queries.key_counts(db)
    limiter = request.app.state.limiter
    budgets = {}
    for team in teams:
        budgets[team.id] = await team_budget(limiter, team)
    return {"teams": teams, "counts": counts, "budgets": budgets}


class TeamsPages(Controller):
    path = "/ui/teams"
    guards = (ui_guard,)
    include_in_schema = False

    @get("/")
    async def list_teams(
        self, request: Request[Any, Any, Any], notice: FromQuery[str | None] = None
    ) -> Template:
        context = await _teams_context(request)
        return render(request, "teams.html", active="teams", flash=notice, **context)

    @post("/")
    async def create_team(self, request: Request[Any, Any, Any]) -> Template | Redirect:
        session = session_of(request)
        form = await request.form()
        check_csrf(session.csrf, form)
        try:
            fields = limit_fields_from_form(form, "team")
            async with sessions(request)() as db, db.begin():
                await service.create_team(db, session.actor, fields, request_id(request))
        except FormError as exc:
            context = await _teams_context(request)
            return render_refused_create(
                request, "teams.html", exc, form, active="teams", **context
            )
        return Redirect("/ui/teams?notice=created", status_code=303)

    @get("/{team_id:uuid}")
    async def edit_team(
        self,
        request: Request[Any, Any, Any],
        team_id: FromPath[uuid.UUID],
        notice: FromQuery[str | None] = None,
    ) -> Template:
        return await self._edit_page(request, team_id, notice=notice)

    async def _edit_page(
        self,
        request: Request[Any, Any, Any],
        team_id: uuid.UUID,
        *,
        notice: str | None = None,
        error: FormError | None = None,
        form: Mapping[str, Any] | None = None,
    ) -> Template:
        session = session_of(request)
        require_team_access(session.actor, team_id)
        async with sessions(request)() as db:
            team = await team_queries.get_team(db, team_id)
        if team is None:
            raise NotFound(f"No team with id '{team_id}'.", param="team_id")
        budget = await team_budget(request.app.state.limiter, team)
        return render_edit(
            request,
            "team_edit.html",
            team,
            active="teams",
            notice=notice,
            error=error,
            form=form,
            team=team,
            budget=budget,
        )

    @post("/{team_id:uuid}")
    async def update_team(
        self, request: Request[Any, Any, Any], team_id: FromPath[uuid.UUID]
    ) -> Template | Redirect:
        session = session_of(request)
        form = await request.form()
        check_csrf(session.csrf, form)
        try:
            changes = limit_fields_from_form(form, "team")
            async with sessions(request)() as db, db.begin():
                _, key_ids = await service.update_team(
                    db, session.actor, team_id, changes, request_id(request)
                )
        except FormError as exc:
            return await self._edit_page(request, team_id, error=exc, form=form)
        await publish_invalidation(request.app.state.redis, *key_ids)
        return Redirect(f"/ui/teams/{team_id}?notice=saved", status_code=303)

    @post("/{team_id:uuid}/delete")
    async def delete_team(
        self, request: Request[Any, Any, Any], team_id: FromPath[uuid.UUID]
    ) -> Redirect:
        session = session_of(request)
        check_csrf(session.csrf, await request.form())
        async with sessions(request)() as db, db.begin():
            await service.delete_team(db, session.actor, team_id, request_id(request))
        return Redirect("/ui/teams?notice=deleted", status_code=303)

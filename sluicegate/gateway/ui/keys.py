"""``/ui/keys``: find, create (the secret shown once), edit limits and budgets, rotate and
revoke keys. A team admin sees and manages its own team's keys only."""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping
from typing import Any

from litestar import Controller, Request, get, post
from litestar.params import FromPath, FromQuery
from litestar.response import Redirect, Template

from sluicegate.gateway.api.admin import service
from sluicegate.gateway.api.admin.reports import key_budget
from sluicegate.gateway.api.admin.schemas import GRACE_MAX_S
from sluicegate.gateway.db import keys as key_queries
from sluicegate.gateway.db import teams as team_queries
from sluicegate.gateway.db.models import ApiKey
from sluicegate.gateway.keys.cache import publish_invalidation
from sluicegate.gateway.ui.common import (
    PAGE_SIZE,
    FormError,
    optional_choice,
    optional_int,
    optional_uuid,
    page_number,
    render,
    request_id,
    sessions,
    text,
)
from sluicegate.gateway.ui.limit_forms import (
    limit_fields_from_form,
    render_edit,
    render_refused_create,
)
from sluicegate.gateway.ui.session import check_csrf, session_of, ui_guard


def _role(form: Mapping[str, Any]) -> str:
    return optional_choice(form, "role", ("member", "team_admin")) or "member"


async def _list_context(
    request: Request[Any, Any, Any], q: str, page: int, show: str, team: str = ""
) -> dict[str, Any]:
    session = session_of(request)
    team_id = session.actor.team_id if not session.is_master else optional_uuid(team, "team")
    filters = {"include_revoked": show != "active", "team_id": team_id, "search": q or None}
    async with sessions(request)() as db:
        total = await key_queries.count_keys(db, **filters)
        rows = await key_queries.list_keys(
            db, limit=PAGE_SIZE, offset=(page - 1) * PAGE_SIZE, **filters
        )
        teams = await team_queries.list_teams(db, limit=1000) if session.is_master else []
    return {
        "keys": rows,
        "teams": teams,
        "team_names": {team.id: team.name for team in teams},
        "q": q,
        "show": show,
        "team": str(team_id or ""),
        "page": page,
        "pages": max(1, math.ceil(total / PAGE_SIZE)),
        "total": total,
    }


async def _secret_page(
    request: Request[Any, Any, Any], row: ApiKey, plaintext: str, *, rotated: bool, grace: int = 0
) -> Template:
    return render(
        request,
        "key_secret.html",
        active="keys",
        key=row,
        secret=plaintext,
        rotated=rotated,
        grace=grace,
        status_code=201 if not rotated else 200,
    )


class KeysPages(Controller):
    path = "/ui/keys"
    guards = (ui_guard,)
    include_in_schema = False

    @get("/")
    async def list_keys(
        self,
        request: Request[Any, Any, Any],
        q: FromQuery[str] = "",
        page: FromQuery[str | None] = None,
        show: FromQuery[str] = "all",
        team: FromQuery[str] = "",
        notice: FromQuery[str | None] = None,
    ) -> Template:
        number = page_number(page)
        try:
            context = await _list_context(request, q.strip(), number, show, team)
        except FormError:
            context = await _list_context(request, q.strip(), number, show)
        return render(request, "keys.html", active="keys", flash=notice, **context)

    @post("/")
    async def create_key(self, request: Request[Any, Any, Any]) -> Template:
        session = session_of(request)
        form = await request.form()
        check_csrf(session.csrf, form)
        try:
            fields = limit_fields_from_form(form, "key")
            team_id = text(form, "team_id") or None
            async with sessions(request)() as db, db.begin():
                row, plaintext = await service.create_key(
                    db, session.actor, {**fields, "role": _role(form)}, team_id, request_id(request)
                )
        except FormError as exc:
            context = await _list_context(request, "", 1, "all")
            return render_refused_create(request, "keys.html", exc, form, active="keys", **context)
        return await _secret_page(request, row, plaintext, rotated=False)

    @get("/{key_id:uuid}")
    async def edit_key(
        self,
        request: Request[Any, Any, Any],
        key_id: FromPath[uuid.UUID],
        notice: FromQuery[str | None] = None,
    ) -> Template:
        return await self._edit_page(request, key_id, notice=notice)

    async def _edit_page(
        self,
        request: Request[Any, Any, Any],
        key_id: uuid.UUID,
        *,
        notice: str | None = None,
        error: FormError | None = None,
        form: Mapping[str, Any] | None = None,
    ) -> Template:
        session = session_of(request)
        async with sessions(request)() as db:
            row = await service.key_for(db, session.actor, key_id)
            team = await team_queries.get_team(db, row.team_id) if row.team_id else None
            teams = await team_queries.list_teams(db, limit=1000) if session.is_master else []
        budget = await key_budget(request.app.state.limiter, row, team)
        return render_edit(
            request,
            "key_edit.html",
            row,
            active="keys",
            notice=notice,
            error=error,
            form=form,
            key=row,
            team=team,
            teams=teams,
            budget=budget,
        )

    @post("/{key_id:uuid}")
    async def update_key(
        self, request: Request[Any, Any, Any], key_id: FromPath[uuid.UUID]
    ) -> Template | Redirect:
        session = session_of(request)
        form = await request.form()
        check_csrf(session.csrf, form)
        try:
            changes = limit_fields_from_form(form, "key")
            if session.is_master:
                changes["team_id"] = text(form, "team_id") or None
                changes["role"] = _role(form)
            async with sessions(request)() as db, db.begin():
                await service.update_key(db, session.actor, key_id, changes, request_id(request))
        except FormError as exc:
            return await self._edit_page(request, key_id, error=exc, form=form)
        await publish_invalidation(request.app.state.redis, str(key_id))
        return Redirect(f"/ui/keys/{key_id}?notice=saved", status_code=303)

    @post("/{key_id:uuid}/rotate")
    async def rotate_key(
        self, request: Request[Any, Any, Any], key_id: FromPath[uuid.UUID]
    ) -> Template:
        session = session_of(request)
        form = await request.form()
        check_csrf(session.csrf, form)
        try:
            grace = optional_int(form, "grace_seconds", maximum=GRACE_MAX_S) or 0
        except FormError as exc:
            return await self._edit_page(request, key_id, error=exc, form=form)
        async with sessions(request)() as db, db.begin():
            row, plaintext = await service.rotate_key(
                db, session.actor, key_id, grace, request_id(request)
            )
        await publish_invalidation(request.app.state.redis, str(key_id))
        return await _secret_page(request, row, plaintext, rotated=True, grace=grace)

    @post("/{key_id:uuid}/revoke")
    async def revoke_key(
        self, request: Request[Any, Any, Any], key_id: FromPath[uuid.UUID]
    ) -> Redirect:
        session = session_of(request)
        check_csrf(session.csrf, await request.form())
        async with sessions(request)() as db, db.begin():
            await service.revoke_key(db, session.actor, key_id, request_id(request))
        await publish_invalidation(request.app.state.redis, str(key_id))
        return Redirect("/ui/keys?notice=revoked", status_code=303)

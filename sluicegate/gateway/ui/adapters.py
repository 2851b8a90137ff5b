"""``/ui/adapters``: LoRA adapters on the base models. The master key registers global ones or
a team's; a team admin registers and deletes its own team's and sees the global ones too. The
rules are the admin API's (``sluicegate.gateway.api.admin.adapters``)."""

from __future__ import annotations

import uuid
from typing import Any

import msgspec
from litestar import Controller, Request, get, post
from litestar.params import FromPath, FromQuery
from litestar.response import Redirect, Template

from sluicegate.gateway.api.admin.adapters import (
    AdapterCreate,
    adapter_fields,
    adapters_for,
    delete_adapter,
    register_adapter,
)
from sluicegate.gateway.db import teams as team_queries
from sluicegate.gateway.errors import OpenAIError
from sluicegate.gateway.routing.adapters import AdapterBook
from sluicegate.gateway.ui.common import render, request_id, sessions
from sluicegate.gateway.ui.session import check_csrf, session_of, ui_guard

_TEXT_FIELDS = ("name", "base_model", "path")
_PRICE_FIELDS = ("input", "output")


def _create_body(form: Any, is_master: bool) -> AdapterCreate:
    body: dict[str, Any] = {name: (form.get(name) or "").strip() for name in _TEXT_FIELDS}
    for name in _PRICE_FIELDS:
        value = (form.get(name) or "").strip()
        if value:
            try:
                body[name] = float(value)
            except ValueError:
                raise msgspec.ValidationError(f"'{name}' must be a number") from None
    team = (form.get("team_id") or "").strip()
    if is_master and team:
        body["team_id"] = team
    return msgspec.convert(body, AdapterCreate)


class AdaptersPages(Controller):
    path = "/ui/adapters"
    guards = (ui_guard,)
    include_in_schema = False

    @get("/")
    async def list_adapters(
        self, request: Request[Any, Any, Any], notice: FromQuery[str | None] = None
    ) -> Template:
        return await self._page(request, flash=notice)

    async def _page(
        self,
        request: Request[Any, Any, Any],
        *,
        flash: str | None = None,
        error: str | None = None,
        form: Any = None,
        status_code: int = 200,
    ) -> Template:
        session = session_of(request)
        async with sessions(request)() as db:
            rows = await adapters_for(db, session.actor, None, None)
            teams = await team_queries.list_teams(db, limit=1000)
        team_names = {str(team.id): team.name for team in teams}
        page = render(
            request,
            "adapters.html",
            active="adapters",
            flash=flash,
            error=error,
            form=form or {},
            adapters=[adapter_fields(row) for row in rows],
            team_names=team_names,
            teams=teams if session.is_master else [],
            models=[route["name"] for route in request.app.state.router.describe()],
        )
        page.status_code = status_code
        return page

    @post("/")
    async def register(self, request: Request[Any, Any, Any]) -> Template | Redirect:
        session = session_of(request)
        form = await request.form()
        check_csrf(session.csrf, form)
        try:
            body = _create_body(form, session.is_master)
            async with sessions(request)() as db, db.begin():
                await register_adapter(db, session.actor, body, request_id(request))
        except msgspec.ValidationError as exc:
            return await self._page(request, error=str(exc), form=form, status_code=400)
        except OpenAIError as exc:
            return await self._page(
                request, error=exc.message, form=form, status_code=exc.status_code
            )
        _book(request).invalidate()
        return Redirect("/ui/adapters?notice=registered", status_code=303)

    @post("/{adapter_id:uuid}/delete")
    async def delete(
        self, request: Request[Any, Any, Any], adapter_id: FromPath[uuid.UUID]
    ) -> Redirect:
        session = session_of(request)
        check_csrf(session.csrf, await request.form())
        async with sessions(request)() as db, db.begin():
            await delete_adapter(db, session.actor, adapter_id, request_id(request))
        _book(request).invalidate()
        return Redirect("/ui/adapters?notice=deleted", status_code=303)


def _book(request: Request[Any, Any, Any]) -> AdapterBook:
    book: AdapterBook = request.app.state.adapters
    return book

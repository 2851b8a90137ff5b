"""``/ui/audit``: who changed what, newest first; a team admin sees its team's entries."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, get
from litestar.params import FromQuery
from litestar.response import Template

from sluicegate.gateway.db import audit as audit_queries
from sluicegate.gateway.ui.common import PAGE_SIZE, page_number, render, sessions
from sluicegate.gateway.ui.session import session_of, ui_guard

ACTIONS = (
    "key.create",
    "key.update",
    "key.rotate",
    "key.revoke",
    "team.create",
    "team.update",
    "team.delete",
    "price.create",
)


class AuditPages(Controller):
    path = "/ui/audit"
    guards = (ui_guard,)
    include_in_schema = False

    @get("/")
    async def audit(
        self,
        request: Request[Any, Any, Any],
        action: FromQuery[str | None] = None,
        target: FromQuery[str | None] = None,
        page: FromQuery[str | None] = None,
    ) -> Template:
        session = session_of(request)
        number = page_number(page)
        async with sessions(request)() as db:
            rows = await audit_queries.list_entries(
                db,
                limit=PAGE_SIZE + 1,
                offset=(number - 1) * PAGE_SIZE,
                action=action or None,
                target_id=(target or "").strip() or None,
                team_id=session.actor.team_id,
            )
        return render(
            request,
            "audit.html",
            active="audit",
            entries=rows[:PAGE_SIZE],
            has_more=len(rows) > PAGE_SIZE,
            page=number,
            action=action or "",
            target=target or "",
            actions=ACTIONS,
        )

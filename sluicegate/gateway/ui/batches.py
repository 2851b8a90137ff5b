"""``/ui/batches``: batches of both APIs, newest first, with progress and cost; a team admin
sees its team's."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, get
from litestar.params import FromQuery
from litestar.response import Template

from sluicegate.gateway.batches.admin_api import STATUSES, admin_view
from sluicegate.gateway.batches.queries import admin_batches
from sluicegate.gateway.ui.common import PAGE_SIZE, page_number, render, sessions
from sluicegate.gateway.ui.session import session_of, ui_guard


class BatchPages(Controller):
    path = "/ui/batches"
    guards = (ui_guard,)
    include_in_schema = False

    @get("/")
    async def batches(
        self,
        request: Request[Any, Any, Any],
        status: FromQuery[str | None] = None,
        page: FromQuery[str | None] = None,
    ) -> Template:
        session = session_of(request)
        number = page_number(page)
        chosen = status if status in STATUSES else None
        async with sessions(request)() as db:
            rows = await admin_batches(
                db,
                key_id=None,
                team_id=session.actor.team_id,
                status=chosen,
                limit=PAGE_SIZE + 1,
                offset=(number - 1) * PAGE_SIZE,
            )
        currency = request.app.state.settings.currency
        return render(
            request,
            "batches.html",
            active="batches",
            batches=[admin_view(b, currency) for b in rows[:PAGE_SIZE]],
            has_more=len(rows) > PAGE_SIZE,
            page=number,
            status=chosen or "",
            statuses=STATUSES,
            multiplier=request.app.state.settings.batch_price_multiplier,
        )

"""``/admin/usage`` (totals over every key, or one team's for a team admin) and
``/admin/models`` (deployments, health, cooldowns)."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

from litestar import Controller, Request, get
from litestar.params import FromQuery

from sluicegate.gateway.api.admin.guards import (
    actor_of,
    admin_guard,
    master_guard,
    require_team_access,
)
from sluicegate.gateway.api.admin.keys import sessions
from sluicegate.gateway.api.admin.reports import usage_report
from sluicegate.gateway.api.admin.schemas import GroupBy, ModelList, UsageReport


class UsageController(Controller):
    path = "/admin"
    guards = (admin_guard,)
    tags = ("admin",)

    @get("/usage")
    async def usage(
        self,
        request: Request[Any, Any, Any],
        key_id: FromQuery[uuid.UUID | None] = None,
        team_id: FromQuery[uuid.UUID | None] = None,
        model: FromQuery[str | None] = None,
        since: FromQuery[dt.date | None] = None,
        until: FromQuery[dt.date | None] = None,
        group_by: FromQuery[GroupBy | None] = None,
    ) -> UsageReport:
        """Totals over UTC days ``since..until`` (inclusive) from the daily rollups; a team
        admin's report covers only its team."""
        actor = actor_of(request)
        if not actor.is_master:
            require_team_access(actor, team_id or actor.team_id)
            team_id = actor.team_id
        async with sessions(request)() as session:
            data, total = await usage_report(
                session,
                key_id=key_id,
                team_id=team_id,
                model=model,
                since=since,
                until=until,
                group_by=group_by,
            )
        currency = request.app.state.settings.currency
        return UsageReport(group_by=group_by, data=data, total=total, currency=currency)

    @get("/models", guards=[master_guard])
    async def models(self, request: Request[Any, Any, Any]) -> ModelList:
        router = getattr(request.app.state, "router", None)
        return ModelList(data=list(router.describe()) if router is not None else [])

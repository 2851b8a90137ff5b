"""``GET /admin/audit``: every admin mutation, newest first, filtered and paged (master only)."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Annotated, Any

from litestar import Controller, Request, get
from litestar.params import FromQuery, Parameter

from sluicegate.gateway.api.admin.guards import admin_guard, master_guard
from sluicegate.gateway.api.admin.keys import sessions
from sluicegate.gateway.api.admin.schemas import AuditList, AuditView
from sluicegate.gateway.db import audit as audit_queries


class AuditController(Controller):
    path = "/admin/audit"
    guards = (admin_guard, master_guard)
    tags = ("admin",)

    @get("/")
    async def list_audit(
        self,
        request: Request[Any, Any, Any],
        actor: FromQuery[str | None] = None,
        action: FromQuery[str | None] = None,
        target_type: FromQuery[str | None] = None,
        target_id: FromQuery[str | None] = None,
        team_id: FromQuery[uuid.UUID | None] = None,
        since: FromQuery[dt.datetime | None] = None,
        until: FromQuery[dt.datetime | None] = None,
        limit: Annotated[int, Parameter(ge=1, le=1000)] = 100,
        offset: Annotated[int, Parameter(ge=0, le=2**62)] = 0,
    ) -> AuditList:
        async with sessions(request)() as session:
            rows = await audit_queries.list_entries(
                session,
                limit=limit + 1,
                offset=offset,
                actor=actor,
                action=action,
                target_type=target_type,
                target_id=target_id,
                team_id=team_id,
                since=since,
                until=until,
            )
        return AuditList(
            data=[AuditView.of(row) for row in rows[:limit]], has_more=len(rows) > limit
        )

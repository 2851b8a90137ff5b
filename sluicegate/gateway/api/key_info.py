"""``GET /v1/key/info``: any key reads itself — limits, budgets, spend and what remains,
for the key and for its team; never its secret."""

from __future__ import annotations

import uuid
from typing import Any

import msgspec
from litestar import Controller, Request, get

from sluicegate.gateway.api.admin.reports import budget_view
from sluicegate.gateway.api.admin.schemas import BudgetView, KeyView, TeamView
from sluicegate.gateway.db import keys as key_queries
from sluicegate.gateway.db import teams as team_queries
from sluicegate.gateway.errors import AuthenticationFailed
from sluicegate.gateway.keys.auth import provide_api_key


class KeyInfo(msgspec.Struct):
    key: KeyView
    budget: BudgetView
    team: TeamView | None
    team_budget: BudgetView | None
    currency: str


class KeyInfoController(Controller):
    path = "/v1/key"
    tags = ("openai",)

    @get("/info", summary="This key's limits, budgets, spend and remaining budget")
    async def key_info(self, request: Request[Any, Any, Any]) -> KeyInfo:
        record = await provide_api_key(request)
        async with request.app.state.db_sessionmaker() as session:
            row = await key_queries.get_key(session, uuid.UUID(record.id))
            team = (
                await team_queries.get_team(session, row.team_id) if row and row.team_id else None
            )
        if row is None:
            raise AuthenticationFailed("This API key no longer exists.")
        limiter = request.app.state.limiter
        return KeyInfo(
            key=KeyView.of(row),
            budget=await budget_view(limiter, "key", record, record.team_id),
            team=TeamView.of(team) if team is not None else None,
            team_budget=await budget_view(limiter, "team", record.team, record.team_id)
            if record.team is not None
            else None,
            currency=request.app.state.settings.currency,
        )

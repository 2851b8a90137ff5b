"""Usage reports and budget views, shared by the admin API, ``/v1/key/info`` and the UI.

A budget view reads the same Redis counters admission compares against (re-seeded from
PostgreSQL when missing), so what it shows as remaining is what admission will allow.
"""

from __future__ import annotations

import datetime as dt
import uuid

import msgspec
from sqlalchemy.ext.asyncio import AsyncSession

from sluicegate.gateway.admission.keys import ScopeLimits
from sluicegate.gateway.admission.limits import RateLimiter
from sluicegate.gateway.api.admin.schemas import BudgetView, GroupBy, UsageRow
from sluicegate.gateway.db import usage_reports as usage_queries
from sluicegate.gateway.db.models import ApiKey, Team
from sluicegate.gateway.keys.records import ApiKeyRecord, TeamLimits
from sluicegate.gateway.usage.pricing import from_micros

_GROUP_FIELD = {"day": "day", "model": "model", "key": "key_id", "team": "team_id"}


def usage_row(totals: usage_queries.UsageTotals, group_by: GroupBy | None = None) -> UsageRow:
    values = totals.as_dict()
    row = UsageRow(**values, cost=from_micros(totals.cost_micros))
    if group_by is not None:
        row = msgspec.structs.replace(row, **{_GROUP_FIELD[group_by]: totals.group})
    return row


async def usage_report(
    session: AsyncSession,
    *,
    key_id: uuid.UUID | None = None,
    team_id: uuid.UUID | None = None,
    model: str | None = None,
    since: dt.date | None = None,
    until: dt.date | None = None,
    group_by: GroupBy | None = None,
) -> tuple[list[UsageRow], UsageRow]:
    groups = await usage_queries.usage_totals(
        session,
        key_id=key_id,
        team_id=team_id,
        model=model,
        since=since,
        until=until,
        group_by=group_by,
    )
    if group_by is None:
        return [], usage_row(groups[0])
    total = usage_queries.UsageTotals(
        sum(g.requests for g in groups),
        sum(g.prompt_tokens for g in groups),
        sum(g.completion_tokens for g in groups),
        sum(g.cost_micros for g in groups),
        sum(g.errors for g in groups),
    )
    return [usage_row(g, group_by) for g in groups], usage_row(total)


async def budget_view(
    limiter: RateLimiter, kind: str, scope: ScopeLimits, team_id: str | None
) -> BudgetView:
    used_tokens, spend_micros = await limiter.counters(kind, scope, team_id)
    token_budget, money_budget = scope.token_budget, scope.max_budget_micros
    return BudgetView(
        token_budget=token_budget,
        max_budget=None if money_budget is None else from_micros(money_budget),
        budget_period=scope.budget_period,
        period_start=usage_queries.budget_period_start(
            scope.budget_period, dt.datetime.now(dt.UTC)
        ),
        used_tokens=used_tokens,
        spend=from_micros(spend_micros),
        spend_micros=spend_micros,
        remaining_tokens=None if token_budget is None else max(0, token_budget - used_tokens),
        remaining=None
        if money_budget is None
        else from_micros(max(0, money_budget - spend_micros)),
    )


async def key_budget(limiter: RateLimiter, key: ApiKey, team: Team | None) -> BudgetView:
    """The budget view of a key as stored (``team``: its team, whose limits it carries)."""
    record = ApiKeyRecord.from_row(key, team)
    return await budget_view(limiter, "key", record, record.team_id)


async def team_budget(limiter: RateLimiter, team: Team) -> BudgetView:
    limits = TeamLimits.from_row(team)
    return await budget_view(limiter, "team", limits, limits.id)

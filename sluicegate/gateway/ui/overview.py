"""The overview: requests, tokens, spend and errors today and over 30 days, and a chart of
daily tokens and spend by model. A team admin sees its team's numbers only."""

from __future__ import annotations

import datetime as dt
from typing import Any

from litestar import Request
from litestar.response import Template

from sluicegate.gateway.db import usage_reports as usage_queries
from sluicegate.gateway.ui.charts import daily_chart
from sluicegate.gateway.ui.common import render, sessions, today
from sluicegate.gateway.ui.session import session_of

DAYS = 30


async def overview_page(request: Request[Any, Any, Any]) -> Template:
    session = session_of(request)
    team_id = session.actor.team_id
    end = today()
    start = end - dt.timedelta(days=DAYS - 1)
    async with sessions(request)() as db:
        (day,) = await usage_queries.usage_totals(db, since=end, until=end, team_id=team_id)
        (month,) = await usage_queries.usage_totals(db, since=start, until=end, team_id=team_id)
        by_model = await usage_queries.usage_totals(
            db, since=start, until=end, team_id=team_id, group_by="model"
        )
        rows = await usage_queries.daily_by_model(db, since=start, until=end, team_id=team_id)
    chart, legend = daily_chart(rows, start, end, request.app.state.settings.currency)
    return render(
        request,
        "overview.html",
        active="overview",
        today=day,
        month=month,
        by_model=sorted(by_model, key=lambda row: -row.total_tokens),
        chart=chart,
        legend=legend,
        has_data=bool(rows),
        start=start,
        end=end,
    )

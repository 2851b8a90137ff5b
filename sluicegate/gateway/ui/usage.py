"""``/ui/usage``: usage and spend filtered by team, key, model and dates, as a chart and
tables; ``/ui/usage.csv`` exports the same selection (one row per day, key and model)."""

from __future__ import annotations

import csv
import datetime as dt
import io
import uuid
from typing import Any

from litestar import Controller, Request, Response, get
from litestar.params import FromQuery
from litestar.response import Template

from sluicegate.gateway.db import keys as key_queries
from sluicegate.gateway.db import teams as team_queries
from sluicegate.gateway.db import usage_reports as usage_queries
from sluicegate.gateway.ui.charts import daily_chart
from sluicegate.gateway.ui.common import (
    FormError,
    optional_date,
    optional_uuid,
    render,
    sessions,
    today,
)
from sluicegate.gateway.ui.session import UiSession, session_of, ui_guard

DEFAULT_DAYS = 30
MAX_DAYS = 366


class Selection:
    """The filters of the page, checked; a team admin's are pinned to its team."""

    def __init__(
        self,
        session: UiSession,
        team_id: str | None,
        key_id: str | None,
        model: str | None,
        since: str | None,
        until: str | None,
    ) -> None:
        self.until = optional_date(until, "until") or today()
        self.since = optional_date(since, "since") or self.until - dt.timedelta(
            days=DEFAULT_DAYS - 1
        )
        if self.since > self.until:
            raise FormError("since", "the first day must not be after the last")
        if (self.until - self.since).days >= MAX_DAYS:
            raise FormError("since", f"choose at most {MAX_DAYS} days")
        self.team_id: uuid.UUID | None = optional_uuid(team_id, "team_id")
        if not session.is_master:
            self.team_id = session.actor.team_id
        self.key_id = optional_uuid(key_id, "key_id")
        self.model = model or None

    def query(self) -> dict[str, Any]:
        return {
            "since": self.since,
            "until": self.until,
            "team_id": self.team_id,
            "key_id": self.key_id,
            "model": self.model,
        }

    def params(self) -> dict[str, str]:
        values = {
            "since": self.since.isoformat(),
            "until": self.until.isoformat(),
            "team_id": str(self.team_id or ""),
            "key_id": str(self.key_id or ""),
            "model": self.model or "",
        }
        return {name: value for name, value in values.items() if value}


class UsagePages(Controller):
    path = "/ui"
    guards = (ui_guard,)
    include_in_schema = False

    @get("/usage")
    async def usage(
        self,
        request: Request[Any, Any, Any],
        team_id: FromQuery[str | None] = None,
        key_id: FromQuery[str | None] = None,
        model: FromQuery[str | None] = None,
        since: FromQuery[str | None] = None,
        until: FromQuery[str | None] = None,
    ) -> Template:
        session = session_of(request)
        error = None
        try:
            selection = Selection(session, team_id, key_id, model, since, until)
        except FormError as exc:
            error = exc.message
            selection = Selection(session, None, None, None, None, None)
        query = selection.query()
        async with sessions(request)() as db:
            (total,) = await usage_queries.usage_totals(db, **query)
            by_day = await usage_queries.usage_totals(db, **query, group_by="day")
            by_model = await usage_queries.usage_totals(db, **query, group_by="model")
            rows = await usage_queries.daily_by_model(db, **query)
            teams = await team_queries.list_teams(db, limit=1000) if session.is_master else []
            keys = await key_queries.list_keys(db, limit=1000, team_id=selection.team_id)
            models = await usage_queries.models_used(db, selection.team_id)
        chart, legend = daily_chart(
            rows, selection.since, selection.until, request.app.state.settings.currency
        )
        return render(
            request,
            "usage.html",
            active="usage",
            status_code=400 if error else 200,
            error=error,
            selection=selection,
            total=total,
            by_day=list(reversed(by_day)),
            by_model=sorted(by_model, key=lambda row: -row.total_tokens),
            chart=chart,
            legend=legend,
            has_data=bool(rows),
            teams=teams,
            keys=keys,
            models=models,
            key_names={str(key.id): key.name for key in keys},
            csv_params=selection.params(),
        )

    @get("/usage.csv")
    async def usage_csv(
        self,
        request: Request[Any, Any, Any],
        team_id: FromQuery[str | None] = None,
        key_id: FromQuery[str | None] = None,
        model: FromQuery[str | None] = None,
        since: FromQuery[str | None] = None,
        until: FromQuery[str | None] = None,
    ) -> Response[str]:
        selection = Selection(session_of(request), team_id, key_id, model, since, until)
        async with sessions(request)() as db:
            rows = await usage_queries.daily_rows(db, **selection.query())
        out = io.StringIO()
        writer = csv.writer(out)
        currency = request.app.state.settings.currency
        writer.writerow(
            [
                "day",
                "team_id",
                "key_id",
                "model",
                "requests",
                "errors",
                "prompt_tokens",
                "completion_tokens",
                "total_tokens",
                f"cost_{currency.lower()}",
                "cost_micros",
            ]
        )
        for row in rows:
            writer.writerow(
                [
                    row.day.isoformat(),
                    row.team_id or "",
                    row.key_id,
                    row.model,
                    row.requests,
                    row.errors,
                    row.prompt_tokens,
                    row.completion_tokens,
                    row.prompt_tokens + row.completion_tokens,
                    f"{row.cost_micros / 1e6:.6f}",
                    row.cost_micros,
                ]
            )
        name = f"usage-{selection.since.isoformat()}-{selection.until.isoformat()}.csv"
        return Response(
            out.getvalue(),
            media_type="text/csv; charset=utf-8",
            headers={"content-disposition": f'attachment; filename="{name}"'},
        )

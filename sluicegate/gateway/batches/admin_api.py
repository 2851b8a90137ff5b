"""``GET /admin/batches``: batches of both APIs per key or team, with their progress, tokens and
cost (at the batch price multiplier); a team admin sees its own team's only."""

from __future__ import annotations

import uuid
from typing import Any

import msgspec
from litestar import Controller, Request, Response, get
from litestar.params import FromQuery

from sluicegate.gateway.api.admin.guards import actor_of, admin_guard, require_team_access
from sluicegate.gateway.batches.creation import sessions
from sluicegate.gateway.batches.queries import admin_batches
from sluicegate.gateway.batches.wire import unix
from sluicegate.gateway.db.batch_tables import Batch
from sluicegate.gateway.errors import InvalidRequest
from sluicegate.gateway.http.json_response import JSONBytes
from sluicegate.gateway.usage.pricing import from_micros

MAX_LIMIT = 500
STATUSES = (
    "validating", "in_progress", "cancelling", "completed", "failed", "expired", "cancelled",
)  # fmt: skip


def admin_view(batch: Batch, currency: str) -> dict[str, Any]:
    done = batch.succeeded + batch.failed
    return {
        "id": batch.id,
        "api": batch.api,
        "key_id": str(batch.key_id),
        "team_id": str(batch.team_id) if batch.team_id else None,
        "endpoint": batch.endpoint,
        "status": batch.status,
        "request_counts": {"total": batch.total, "completed": batch.succeeded,
                           "failed": batch.failed},
        "progress": done / batch.total if batch.total else 1.0,
        "prompt_tokens": batch.prompt_tokens,
        "completion_tokens": batch.completion_tokens,
        "cost": from_micros(batch.cost_micros),
        "cost_micros": batch.cost_micros,
        "currency": currency,
        "created_at": unix(batch.created_at),
        "ended_at": unix(batch.ended_at),
    }  # fmt: skip


class BatchesAdminController(Controller):
    path = "/admin/batches"
    guards = (admin_guard,)
    tags = ("admin",)

    @get("/", summary="Batches per key or team, with progress and cost")
    async def list_batches(
        self,
        request: Request[Any, Any, Any],
        key_id: FromQuery[uuid.UUID | None] = None,
        team_id: FromQuery[uuid.UUID | None] = None,
        status: FromQuery[str | None] = None,
        limit: FromQuery[int] = 100,
        offset: FromQuery[int] = 0,
    ) -> Response[bytes]:
        actor = actor_of(request)
        if not actor.is_master:
            require_team_access(actor, team_id or actor.team_id)
            team_id = actor.team_id
        if status is not None and status not in STATUSES:
            raise InvalidRequest(f"'status' must be one of {', '.join(STATUSES)}.", param="status")
        if not 1 <= limit <= MAX_LIMIT:
            raise InvalidRequest(f"'limit' must be from 1 to {MAX_LIMIT}.", param="limit")
        if offset < 0:
            raise InvalidRequest("'offset' must not be negative.", param="offset")
        async with sessions(request)() as session:
            rows = await admin_batches(
                session, key_id=key_id, team_id=team_id, status=status, limit=limit, offset=offset
            )
        currency = request.app.state.settings.currency
        body = {"object": "list", "data": [admin_view(b, currency) for b in rows]}
        return JSONBytes(msgspec.json.encode(body), headers={})

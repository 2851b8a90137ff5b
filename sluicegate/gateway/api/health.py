"""Liveness and readiness probes.

Ready means this replica can serve: Redis answers (admission, engine streams and the key cache's
invalidations all go through it) and the routing table is loaded. PostgreSQL is reported but
does not gate readiness: cached keys keep working and usage is written behind through an
outage, so a short database blip must not empty the Service of every replica at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from litestar import Controller, Request, Response, get
from sqlalchemy import text

from sluicegate.gateway.errors import error_body

PROBE_TIMEOUT_S = 2.0
GATING_CHECKS = ("redis", "routing")


async def _probe(check: Awaitable[Any]) -> str:
    try:
        await asyncio.wait_for(check, PROBE_TIMEOUT_S)
    except Exception as exc:
        return f"error: {type(exc).__name__}: {exc}".rstrip(": ")
    return "ok"


async def _database_answers(request: Request[Any, Any, Any]) -> None:
    async with request.app.state.db_sessionmaker() as session:
        await session.execute(text("SELECT 1"))


class HealthController(Controller):
    path = "/health"
    tags = ("health",)

    @get("/live")
    async def live(self) -> dict[str, str]:
        return {"status": "ok"}

    @get("/ready")
    async def ready(self, request: Request[Any, Any, Any]) -> Response[dict[str, Any]]:
        state = request.app.state
        redis, routing, database = await asyncio.gather(
            _probe(state.redis.ping()),
            _probe(state.router.load()),
            _probe(_database_answers(request)),
        )
        checks = {"redis": redis, "routing": routing, "database": database}
        failing = [name for name in GATING_CHECKS if checks[name] != "ok"]
        if not failing:
            return Response({"status": "ok", "checks": checks})
        body = error_body(f"Not ready: {', '.join(failing)} not ok.", "service_unavailable")
        return Response({**body, "status": "unavailable", "checks": checks}, status_code=503)

"""Liveness and readiness probes: ready means PostgreSQL and Redis both answer."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from litestar import Controller, Request, Response, get
from sqlalchemy import text

from gateway.errors import error_body

PROBE_TIMEOUT_S = 2.0


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
        database, redis = await asyncio.gather(
            _probe(_database_answers(request)), _probe(request.app.state.redis.ping())
        )
        checks = {"database": database, "redis": redis}
        if database == "ok" and redis == "ok":
            return Response({"status": "ok", "checks": checks})
        failing = ", ".join(name for name, state in checks.items() if state != "ok")
        body = error_body(f"Not ready: {failing} unreachable.", "service_unavailable")
        return Response({**body, "status": "unavailable", "checks": checks}, status_code=503)

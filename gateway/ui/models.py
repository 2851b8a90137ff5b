"""``/ui/models``: the routing table (deployments, health, cooldowns) and the engine workers
as their heartbeats describe them (running and waiting requests, KV-cache use)."""

from __future__ import annotations

import time
from typing import Any

from litestar import Controller, Request, get
from litestar.response import Template

from engine import protocol
from gateway.ui.common import render
from gateway.ui.session import ui_guard

MAX_WORKERS_SHOWN = 500


async def worker_heartbeats(request: Request[Any, Any, Any]) -> list[protocol.Heartbeat]:
    redis = request.app.state.redis
    names = []
    async for name in redis.scan_iter(match=protocol.heartbeat_pattern(), count=500):
        names.append(name)
        if len(names) >= MAX_WORKERS_SHOWN:
            break
    beats = []
    for raw in await redis.mget(names) if names else []:
        if raw is None:
            continue
        try:
            message = protocol.decode(raw)
        except ValueError:
            continue
        if isinstance(message, protocol.Heartbeat):
            beats.append(message)
    return sorted(beats, key=lambda beat: (beat.model, beat.worker_id))


class ModelsPages(Controller):
    path = "/ui/models"
    guards = (ui_guard,)
    include_in_schema = False

    @get("/")
    async def models(self, request: Request[Any, Any, Any]) -> Template:
        router = request.app.state.router
        return render(
            request,
            "models.html",
            active="models",
            routes=router.describe(),
            workers=await worker_heartbeats(request),
            prices=request.app.state.prices.configured,
            now=time.time(),
        )

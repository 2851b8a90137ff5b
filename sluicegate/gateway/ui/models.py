"""``/ui/models``: the routing table (deployments, health, cooldowns) and the engine workers
as their heartbeats describe them (running and waiting requests, KV-cache use)."""

from __future__ import annotations

import time
from typing import Any

from litestar import Controller, Request, get
from litestar.response import Template

from sluicegate.engine import protocol, redis_names
from sluicegate.gateway.ui.common import render
from sluicegate.gateway.ui.session import ui_guard

MAX_MODELS_SHOWN = 200
RECENT_S = 3600.0
"""Models whose workers beat within this long are looked at (the registry keeps older ones)."""


async def worker_heartbeats(request: Request[Any, Any, Any]) -> list[protocol.Heartbeat]:
    """Every live worker's latest heartbeat: models from the registry workers stamp, then each
    model's worker set and heartbeat keys (one slot per model, so a Redis Cluster works)."""
    redis = request.app.state.redis
    # Newest first: with more than MAX_MODELS_SHOWN recent models, the ones beating now.
    recent = await redis.zrevrangebyscore(
        redis_names.MODEL_REGISTRY, "+inf", time.time() - RECENT_S, start=0, num=MAX_MODELS_SHOWN
    )
    beats = []
    for raw_model in recent:
        model = raw_model.decode() if isinstance(raw_model, bytes) else raw_model
        ids = [
            w.decode() if isinstance(w, bytes) else w
            for w in await redis.smembers(redis_names.worker_registry(model))
        ]
        if not ids:
            continue
        for raw in await redis.mget([redis_names.heartbeat_key(model, w) for w in ids]):
            if raw is None:
                continue
            try:
                message = protocol.decode(raw)
            except protocol.MalformedMessage:
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

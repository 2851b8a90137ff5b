"""Discovery: with no routing file, the models are those of live engine workers.

Workers stamp their model in one sorted set (``MODEL_REGISTRY``) each heartbeat; a read of it
(at most once a second: one command, no SCAN) turns each model seen within the last hour into
a route with one ``engine`` deployment, so a single-machine ``sluicegate up`` needs no
configuration.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from redis.asyncio import Redis

from sluicegate.engine.redis_names import MODEL_REGISTRY

DISCOVERY_REFRESH_S = 1.0
DISCOVERY_WINDOW_S = 3600.0
"""A model whose workers last beat longer ago than this is not added (one added stays)."""


class Discovery:
    def __init__(self, redis: Redis, add_engine_model: Callable[[str], None]) -> None:
        self._redis = redis
        self._add = add_engine_model
        self._known: set[str] = set()
        self.refreshed_at = 0.0

    async def refresh(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.refreshed_at < DISCOVERY_REFRESH_S:
            return
        self.refreshed_at = now
        since = time.time() - DISCOVERY_WINDOW_S
        models = {
            m.decode() if isinstance(m, bytes) else m
            for m in await self._redis.zrangebyscore(MODEL_REGISTRY, since, "+inf")
        }
        for model in sorted(models - self._known):
            self._known.add(model)
            self._add(model)

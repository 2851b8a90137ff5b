"""``GET /v1/key/info``: any key reads itself — limits, budgets, spend and what remains,
for the key and for its team; never its secret.

Each answer costs database queries, so a key may ask ``key_info_requests_per_min`` times a
minute, counted in Redis across replicas (a fixed window per key); past it, a 429 in OpenAI's
shape.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec
from litestar import Controller, Request, get
from redis.asyncio import Redis
from redis.exceptions import RedisError

from sluicegate.gateway.api.admin.reports import budget_view
from sluicegate.gateway.api.admin.schemas import BudgetView, KeyView, TeamView
from sluicegate.gateway.db import keys as key_queries
from sluicegate.gateway.db import teams as team_queries
from sluicegate.gateway.errors import AuthenticationFailed, RateLimited, ServiceUnavailable
from sluicegate.gateway.keys.auth import provide_api_key
from sluicegate.gateway.keys.records import ApiKeyRecord
from sluicegate.gateway.settings import Settings

WINDOW_S = 60


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
        await _count_request(request.app.state.redis, request.app.state.settings, record)
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


async def _count_request(redis: Redis, settings: Settings, record: ApiKeyRecord) -> None:
    """Counts this request against the key's cap; raises ``RateLimited`` past it."""
    limit = settings.key_info_requests_per_min
    if limit <= 0:
        return
    now = time.time()
    window = int(now // WINDOW_S)
    counter = f"sg:keyinfo:{{{record.id}}}:{window}"
    try:
        async with redis.pipeline(transaction=False) as pipe:
            pipe.incr(counter)
            # Set on every request, not only the first: a counter whose first EXPIRE was lost
            # would otherwise stay in Redis for good.
            pipe.expire(counter, WINDOW_S * 2)
            count, _ = await pipe.execute()
    except (RedisError, OSError, TimeoutError) as exc:
        raise ServiceUnavailable("Key information is not available right now.") from exc
    if count > limit:
        raise RateLimited(
            f"Rate limit reached for /v1/key/info: {limit} requests per minute per key.",
            limit="requests",
            retry_after_s=(window + 1) * WINDOW_S - now,
        )

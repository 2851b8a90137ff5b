"""A call's settlement goes to Redis ahead of whatever request the loop reads after its
response: a sequential client with one parallel request never meets its own slot."""

from __future__ import annotations

import asyncio

from redis.asyncio import Redis

from sluicegate.gateway.admission.limits import RateLimiter
from sluicegate.gateway.routing.router import Router
from sluicegate.gateway.services import Services
from sluicegate.gateway.settings import Settings
from sluicegate.gateway.usage.stream import UsageRecorder


async def test_a_settlement_runs_before_a_request_read_in_the_same_loop_turn(
    redis_url: str,
) -> None:
    settings = Settings(redis_url=redis_url)
    redis = Redis.from_url(redis_url)
    services = Services(
        settings=settings,
        router=Router.from_settings(settings, redis),
        limiter=RateLimiter(redis, slot_ttl_s=settings.request_timeout_s),
        recorder=UsageRecorder(redis, settings),
        redis=redis,
    )
    order: list[str] = []

    async def settlement() -> None:
        order.append("settle")

    services.settle_soon(settlement())
    # A loaded loop reads the client's next request in the same turn as its answer left:
    # the reading schedules that request's first step right behind the handler's.
    asyncio.get_running_loop().call_soon(order.append, "next request")
    await services.drain_settlements()
    await asyncio.sleep(0)
    assert order == ["settle", "next request"]
    await services.router.close()
    await redis.aclose()

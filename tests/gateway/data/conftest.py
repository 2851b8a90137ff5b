"""An app made of the data engineer's controllers, wired the way ``create_app`` wires them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from litestar import Litestar
from litestar.datastructures import State
from litestar.testing import AsyncTestClient
from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.api.admin import AdminController
from gateway.api.health import HealthController
from gateway.auth import KeyCache
from gateway.db.session import create_engine, create_sessionmaker
from gateway.errors import EXCEPTION_HANDLERS
from gateway.settings import Settings


@asynccontextmanager
async def _services(app: Litestar) -> AsyncIterator[None]:
    # Built inside the app's own event loop: the test client runs the app in another loop.
    settings: Settings = app.state.settings
    redis = Redis.from_url(settings.redis_url)
    engine = create_engine(settings.database_url)
    app.state.redis = redis
    app.state.db_sessionmaker = create_sessionmaker(engine)
    try:
        yield
    finally:
        await redis.aclose()
        await engine.dispose()


def build_app(settings: Settings, router: Any = None) -> Litestar:
    state: dict[str, Any] = {"settings": settings}
    if router is not None:
        state["router"] = router
    return Litestar(
        route_handlers=[AdminController, HealthController],
        exception_handlers=EXCEPTION_HANDLERS,
        lifespan=[_services],
        state=State(state),
    )


@pytest.fixture
async def admin_client(gateway_settings: Settings) -> AsyncIterator[AsyncTestClient[Litestar]]:
    async with AsyncTestClient(build_app(gateway_settings)) as client:
        client.headers["authorization"] = f"Bearer {gateway_settings.master_key}"
        yield client


@pytest.fixture
async def key_cache(
    gateway_settings: Settings,
    redis_client: Redis,
    db_sessionmaker: async_sessionmaker[AsyncSession],
) -> AsyncIterator[KeyCache]:
    cache = KeyCache(redis_client, db_sessionmaker, gateway_settings)
    await cache.start()
    yield cache
    await cache.stop()

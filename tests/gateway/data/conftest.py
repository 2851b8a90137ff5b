"""An app made of the data engineer's controllers, wired the way ``create_app`` wires them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from litestar import Litestar
from litestar.datastructures import State
from litestar.testing import AsyncTestClient
from redis.asyncio import Redis
from sqlalchemy.engine import make_url
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


class TcpProxy:
    """A TCP relay in front of PostgreSQL that a test can take down and bring back.

    While stopped, connections are refused and open ones are cut: to a client it looks
    exactly like a database outage.
    """

    def __init__(self, database_url: str) -> None:
        url = make_url(database_url)
        socket_dir = url.query.get("host")
        self._socket_path = f"{socket_dir}/.s.PGSQL.{url.port or 5432}" if socket_dir else None
        self._target = (url.host or "127.0.0.1", url.port or 5432)
        self._url = url
        self._server: asyncio.Server | None = None
        self._transports: set[asyncio.BaseTransport] = set()
        self.port = 0

    @property
    def url(self) -> str:
        proxied = self._url.set(host="127.0.0.1", port=self.port, query={})
        return proxied.render_as_string(hide_password=False)

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._relay, "127.0.0.1", self.port, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for transport in list(self._transports):
            transport.abort()
        await self._server.wait_closed()
        self._server = None

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            if self._socket_path:
                up_reader, up_writer = await asyncio.open_unix_connection(self._socket_path)
            else:
                up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.transport.abort()
            return
        self._transports |= {writer.transport, up_writer.transport}
        await asyncio.gather(
            self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True
        )
        self._transports -= {writer.transport, up_writer.transport}

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        finally:
            writer.transport.abort()


@pytest.fixture
async def db_proxy(gateway_settings: Settings) -> AsyncIterator[TcpProxy]:
    proxy = TcpProxy(gateway_settings.database_url)
    await proxy.start()
    yield proxy
    await proxy.stop()

"""Fixtures of the data tests: the whole app with the master key, a key cache, a DB relay."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any

import pytest
from litestar import Litestar
from litestar.testing import AsyncTestClient
from redis.asyncio import Redis
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluicegate.gateway.app import create_app
from sluicegate.gateway.keys.cache import KeyCache
from sluicegate.gateway.settings import Settings


@pytest.fixture
def routing_yaml(tmp_path: Path) -> Path:
    path = tmp_path / "routing.yaml"
    path.write_text(
        "models:\n"
        "  - name: tiny\n"
        "    aliases: [tiny-alias]\n"
        "    deployments:\n"
        "      - provider: openai\n"
        "        base_url: http://127.0.0.1:9/v1\n"
        "        model: upstream-tiny\n"
    )
    return path


@pytest.fixture
async def admin_client(
    gateway_settings: Settings, routing_yaml: Path
) -> AsyncIterator[AsyncTestClient[Litestar]]:
    """The whole gateway app (usage flusher included), holding the master key, over https as
    behind a TLS ingress: the UI's cookies are ``Secure``, and httpx sends them back only so."""
    settings = dataclasses.replace(gateway_settings, config=str(routing_yaml))
    async with AsyncTestClient(create_app(settings), base_url="https://testserver.local") as client:
        client.headers["authorization"] = f"Bearer {settings.master_key}"
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
    exactly like a database outage. It runs its own event loop on a thread, so it keeps
    relaying while the test's loop is blocked (Litestar's test client blocks it).
    """

    def __init__(self, database_url: str) -> None:
        url = make_url(database_url)
        socket_dir = url.query.get("host")
        self._socket_path = f"{socket_dir}/.s.PGSQL.{url.port or 5432}" if socket_dir else None
        self._target = (url.host or "127.0.0.1", url.port or 5432)
        self._url = url
        self._server: asyncio.Server | None = None
        self._transports: set[asyncio.BaseTransport] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.port = 0

    @property
    def url(self) -> str:
        proxied = self._url.set(host="127.0.0.1", port=self.port, query={})
        return proxied.render_as_string(hide_password=False)

    async def start(self) -> None:
        await self._on_thread(self._start())

    async def stop(self) -> None:
        await self._on_thread(self._stop())

    async def close(self) -> None:
        await self.stop()
        self._loop.call_soon_threadsafe(self._loop.stop)
        await asyncio.to_thread(self._thread.join, 5)
        self._loop.close()

    async def _on_thread(self, coroutine: Coroutine[Any, Any, None]) -> None:
        await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, self._loop))

    async def _start(self) -> None:
        self._server = await asyncio.start_server(
            self._relay, "127.0.0.1", self.port, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def _stop(self) -> None:
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
    await proxy.close()

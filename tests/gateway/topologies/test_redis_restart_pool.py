"""A single Redis restarted under an asyncio client of sluicegate/engine/redis_client.py (the gateway's):
the connections it pooled before the restart are found closed when taken from the pool, so no
command fails on one, and none runs twice (the gateway's admission script must not)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from sluicegate.engine.redis_client import async_client

from .redis_servers import _Servers, free_ports

COUNT = "return redis.call('INCR', KEYS[1])"
"""Not idempotent, like the admission script: a command run twice would show."""


def _restart(servers: _Servers, port: int) -> None:
    process = servers.processes.pop()
    process.kill()
    process.wait(10)
    servers.spawn(port)


async def test_async_connections_pooled_before_a_restart_are_not_failed_on(
    tmp_path: Path,
) -> None:
    (port,) = free_ports(1)
    servers = _Servers(tmp_path)
    servers.spawn(port)
    client = async_client(f"redis://127.0.0.1:{port}/0", socket_timeout=5.0)
    try:
        await asyncio.gather(*(client.ping() for _ in range(4)))  # four pooled connections
        # In a thread, so this loop sees the server close them, as the gateway's would.
        await asyncio.to_thread(_restart, servers, port)
        counts = await asyncio.gather(*(client.eval(COUNT, 1, "n") for _ in range(4)))
        assert sorted(counts) == [1, 2, 3, 4]  # Redis came back empty: each ran once
    finally:
        await client.aclose()
        servers.close()

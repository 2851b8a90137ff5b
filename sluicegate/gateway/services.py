"""What every request handler shares: the services built at startup, the per-request state
in the ASGI scope, and the guard that authenticates the key before the body is read."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler
from redis.asyncio import Redis

from sluicegate.engine.tracing import tracing_enabled
from sluicegate.gateway.admission.limits import RateLimiter
from sluicegate.gateway.keys.auth import provide_api_key
from sluicegate.gateway.leases.book import LeaseBook
from sluicegate.gateway.routing.adapters import AdapterBook
from sluicegate.gateway.routing.router import Router
from sluicegate.gateway.settings import Settings
from sluicegate.gateway.telemetry import start_server_span
from sluicegate.gateway.usage.stream import UsageRecorder


def new_request_id() -> str:
    return os.urandom(12).hex()


def request_state(scope: Any) -> dict[str, Any]:
    """Per-request values of ours (request id, start time, key) in the ASGI scope state."""
    state = scope.get("state")
    if state is None:
        state = scope["state"] = {}
    return state  # type: ignore[no-any-return]


@dataclass(slots=True)
class Services:
    """What the request path needs, built once by the app's lifespan."""

    settings: Settings
    router: Router
    limiter: RateLimiter
    recorder: UsageRecorder
    redis: Redis
    started_at: int = field(default_factory=lambda: int(time.time()))
    leases: LeaseBook | None = None
    adapters: AdapterBook | None = None
    """The LoRA adapter registry (None: no adapters, as in apps built without a database)."""
    settling: set[asyncio.Task[None]] = field(default_factory=set)
    """Settlements of answered calls still under way (``settle_soon``)."""

    def settle_soon(self, settlement: Coroutine[Any, Any, None]) -> None:
        """Run a call's settlement beside its response instead of before it: the client has
        its answer one Redis round trip sooner. Its task is made now, before the response is
        written, so its first step (which sends the settle) is queued ahead of any request the
        loop reads afterwards: a sequential client's next request finds its slot free. Made
        on the next loop turn instead, a loaded loop read the next request in the same turn
        as the response left, and that request's admission reached Redis first (a 429 to a
        client with one parallel request). Crash-safe as before: until the settle lands, the
        call's lease is renewed."""
        task = asyncio.ensure_future(settlement)
        self.settling.add(task)
        task.add_done_callback(self.settling.discard)

    async def drain_settlements(self) -> None:
        """Wait for every settlement under way (shutdown, before the lease book stops)."""
        while self.settling:
            await asyncio.gather(*self.settling, return_exceptions=True)


async def authenticate(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """Guard: runs before the body is read, so a bad key is a 401 whatever the body says."""
    scope = connection.scope
    state = request_state(scope)
    state["started"] = time.perf_counter()
    state["request_id"] = new_request_id()
    state["auth_started_ns"] = now_ns = time.time_ns()
    if tracing_enabled():
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        state["server_span"] = start_server_span(
            f"{scope['method']} {scope['path']}", headers, now_ns
        )
    state["api_key"] = await provide_api_key(connection)  # type: ignore[arg-type]

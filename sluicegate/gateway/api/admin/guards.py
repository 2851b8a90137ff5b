"""Who may call the admin API: the master key (everything) or a team admin's key (its team).

``admin_guard`` resolves the caller into an ``Actor`` on the request state (and gives the
request its id for the audit log); ``master_guard`` refuses team admins with a 403.
``require_team_access`` is the per-object check: a team admin touching another team's key gets
a 403 whatever route it came through.

Wrong admin keys are throttled per client address (``admin_auth_failures_per_min``): past the
cap, every admin authentication from that address gets a 429 until the window ends, the right
master key's included, since a 429 that only wrong guesses got would tell a right one apart.
"""

from __future__ import annotations

import hmac
import os
import uuid
from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from sluicegate.gateway.db.audit import Actor
from sluicegate.gateway.errors import AuthenticationFailed, PermissionDenied, RateLimited
from sluicegate.gateway.keys.auth import bearer_token, client_address
from sluicegate.gateway.keys.cache import KeyCache
from sluicegate.gateway.keys.throttle import FailureThrottle
from sluicegate.gateway.settings import Settings

ADMIN_DENIED = "admin_forbidden"


def _state(connection: ASGIConnection[Any, Any, Any, Any]) -> dict[str, Any]:
    state = connection.scope.get("state")
    if state is None:
        state = connection.scope["state"] = {}
    return state  # type: ignore[no-any-return]


def is_master_key(settings: Settings, token: str) -> bool:
    master = settings.master_key
    return bool(master) and hmac.compare_digest(token.encode(), master.encode())


async def actor_for_token(
    settings: Settings,
    cache: KeyCache,
    throttle: FailureThrottle,
    token: str | None,
    client: str,
) -> Actor:
    """The admin identity of a bearer token; 401 for no or a bad key, 403 for a plain key,
    429 while ``client`` has failed too often (``throttle``)."""
    if token is None:
        raise AuthenticationFailed(
            "An admin key is required: the master key or a team admin's key."
        )
    retry_after = throttle.retry_after(client)
    if retry_after is not None:
        raise RateLimited(
            "Too many failed admin authentications from this address; try again later.",
            limit="requests",
            retry_after_s=retry_after,
            code="admin_auth_rate_limited",
        )
    if is_master_key(settings, token):
        return Actor()
    try:
        record = await cache.lookup(token, client)
    except AuthenticationFailed:
        # Most master-key guesses are not shaped like API keys, so the unknown-key throttle
        # never sees them; this one counts every wrong admin key.
        throttle.record_failure(client)
        raise
    if record.role != "team_admin" or record.team is None:
        raise PermissionDenied(
            "This key may not use the admin API: only the master key and team admin keys may.",
            code=ADMIN_DENIED,
        )
    return Actor(key_id=uuid.UUID(record.id), team_id=uuid.UUID(record.team.id))


async def admin_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    state = _state(connection)
    state.setdefault("request_id", os.urandom(12).hex())
    token = bearer_token(connection.headers.get("authorization"))
    app_state = connection.app.state
    state["actor"] = await actor_for_token(
        app_state.settings,
        app_state.key_cache,
        app_state.admin_auth_throttle,
        token,
        client_address(connection),
    )


def master_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """After ``admin_guard``: only the master key passes."""
    if not actor_of(connection).is_master:
        raise PermissionDenied("Only the master key may do this.", code=ADMIN_DENIED)


def actor_of(connection: ASGIConnection[Any, Any, Any, Any]) -> Actor:
    actor: Actor = _state(connection)["actor"]
    return actor


def request_id_of(connection: ASGIConnection[Any, Any, Any, Any]) -> str | None:
    request_id: str | None = _state(connection).get("request_id")
    return request_id


def require_team_access(actor: Actor, team_id: uuid.UUID | None) -> None:
    """A team admin may touch only its own team's objects."""
    if not actor.is_master and team_id != actor.team_id:
        raise PermissionDenied(
            "This key may manage only the keys and usage of its own team.", code=ADMIN_DENIED
        )

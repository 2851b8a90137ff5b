"""Sign-in sessions of the web UI, kept in Redis, and their CSRF tokens.

The browser holds only a random session id in an HttpOnly, SameSite=Strict cookie (Secure
unless ``ui_insecure_cookies``); the API key it signed in with is never stored anywhere, only
its hash. Every request re-checks that the key still is what it was (not revoked, expired,
rotated away or demoted), so revoking a team admin's key signs its UI sessions out at once.
Forms carry the session's CSRF token; the sign-in form, which has no session yet, uses a
double-submit cookie instead.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import os
import secrets
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec
from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler
from redis.asyncio import Redis

from sluicegate.gateway.db import keys as key_queries
from sluicegate.gateway.db import teams as team_queries
from sluicegate.gateway.db.audit import Actor
from sluicegate.gateway.keys.records import hash_key
from sluicegate.gateway.settings import Settings

SESSION_COOKIE = "sg_ui_session"
SIGNIN_CSRF_COOKIE = "sg_ui_signin"
SESSION_TTL_S = 8 * 3600
CSRF_FIELD = "csrf_token"


class NotSignedIn(Exception):
    """The request has no valid session: the UI answers with the sign-in page."""


class CsrfRejected(Exception):
    """A form came without the token of its session."""


class StoredSession(msgspec.Struct):
    csrf: str
    key_hash: str
    """SHA-256 of the key signed in with (the master key's too)."""
    key_id: str | None = None
    team_id: str | None = None


@dataclass(frozen=True, slots=True)
class UiSession:
    id_hash: str
    csrf: str
    actor: Actor
    team_name: str | None = None

    @property
    def is_master(self) -> bool:
        return self.actor.is_master


def _redis_key(id_hash: str) -> str:
    return f"sg:ui:session:{id_hash}"


def _id_hash(session_id: str) -> str:
    return hashlib.sha256(session_id.encode()).hexdigest()


async def open_session(redis: Redis, stored: StoredSession) -> str:
    """Stores a new session; returns the id for the cookie."""
    session_id = secrets.token_urlsafe(32)
    await redis.set(_redis_key(_id_hash(session_id)), msgspec.json.encode(stored), ex=SESSION_TTL_S)
    return session_id


async def close_session(redis: Redis, session_id: str | None) -> None:
    if session_id:
        await redis.delete(_redis_key(_id_hash(session_id)))


async def load_session(connection: ASGIConnection[Any, Any, Any, Any]) -> UiSession:
    session_id = connection.cookies.get(SESSION_COOKIE)
    if not session_id:
        raise NotSignedIn
    id_hash = _id_hash(session_id)
    raw = await connection.app.state.redis.get(_redis_key(id_hash))
    if raw is None:
        raise NotSignedIn
    stored = msgspec.json.decode(raw, type=StoredSession)
    settings: Settings = connection.app.state.settings
    if stored.key_id is None:
        if not settings.master_key or not hmac.compare_digest(
            stored.key_hash, hash_key(settings.master_key)
        ):
            raise NotSignedIn
        return UiSession(id_hash, stored.csrf, Actor())
    async with connection.app.state.db_sessionmaker() as db:
        row = await key_queries.get_key(db, uuid.UUID(stored.key_id))
        team = None
        if row is not None and row.team_id is not None:
            team = await team_queries.get_team(db, row.team_id)
    if row is None or not _still_valid(row, stored):
        raise NotSignedIn
    actor = Actor(key_id=row.id, team_id=row.team_id)
    return UiSession(id_hash, stored.csrf, actor, team.name if team else None)


def _still_valid(row: Any, stored: StoredSession) -> bool:
    now = dt.datetime.now(dt.UTC)
    if row.revoked_at is not None or row.role != "team_admin" or row.team_id is None:
        return False
    if str(row.team_id) != stored.team_id:
        return False
    if row.expires_at is not None and row.expires_at <= now:
        return False
    if hmac.compare_digest(row.key_hash, stored.key_hash):
        return True
    return (
        row.previous_key_hash is not None
        and hmac.compare_digest(row.previous_key_hash, stored.key_hash)
        and row.previous_key_expires_at is not None
        and row.previous_key_expires_at > now
    )


async def ui_guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """Guard of every signed-in page; the session lands on ``request.state.ui``."""
    state = connection.scope.setdefault("state", {})  # type: ignore[typeddict-item]
    state.setdefault("request_id", os.urandom(12).hex())
    state["ui"] = await load_session(connection)


def session_of(connection: ASGIConnection[Any, Any, Any, Any]) -> UiSession:
    session: UiSession = connection.scope["state"]["ui"]  # type: ignore[typeddict-item]
    return session


def check_csrf(expected: str, form: Any) -> None:
    sent = form.get(CSRF_FIELD) if form is not None else None
    if not sent or not hmac.compare_digest(str(sent), expected):
        raise CsrfRejected

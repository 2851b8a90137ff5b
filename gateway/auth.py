"""API keys on the request path: generation, hashing, the records, how a request presents one.

A key is ``sk-`` plus 43 url-safe random characters; only its SHA-256 hex and a short display
prefix reach the database. ``provide_api_key`` reads the key a request presents (``Authorization:
Bearer`` or ``x-api-key``) and answers it from the replica's ``KeyCache`` (``gateway.key_cache``).
A token not shaped like a key is refused without a query.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import re
import secrets
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import msgspec
from litestar.connection import ASGIConnection

from gateway.db.models import ApiKey, Team
from gateway.errors import AuthenticationFailed
from gateway.settings import Settings

if TYPE_CHECKING:
    from gateway.key_cache import KeyCache

KEY_PREFIX = "sk-"
KEY_RANDOM_BYTES = 32
DISPLAY_PREFIX_CHARS = 10
KEY_SHAPE = re.compile(r"sk-[A-Za-z0-9_-]{43}")
"""What ``generate_key`` makes; anything else cannot be a key and is refused unasked."""


def hash_key(plaintext: str) -> str:
    return hashlib.sha256(plaintext.encode()).hexdigest()


def generate_key() -> tuple[str, str, str]:
    """Returns ``(plaintext, sha256_hex, display_prefix)``; show the plaintext once, store the rest."""
    plaintext = KEY_PREFIX + secrets.token_urlsafe(KEY_RANDOM_BYTES)
    return plaintext, hash_key(plaintext), plaintext[:DISPLAY_PREFIX_CHARS]


class TeamLimits(msgspec.Struct, frozen=True):
    """A team's limits, which bind the sum of its keys (None = unlimited)."""

    id: str
    name: str
    allowed_models: list[str]
    rpm_limit: int | None
    tpm_limit: int | None
    max_parallel_requests: int | None
    token_budget: int | None
    max_budget_micros: int | None
    budget_period: str | None

    @classmethod
    def from_row(cls, row: Team) -> TeamLimits:
        return cls(
            id=str(row.id),
            name=row.name,
            allowed_models=list(row.allowed_models),
            rpm_limit=row.rpm_limit,
            tpm_limit=row.tpm_limit,
            max_parallel_requests=row.max_parallel_requests,
            token_budget=row.token_budget,
            max_budget_micros=row.max_budget_micros,
            budget_period=row.budget_period,
        )


class ApiKeyRecord(msgspec.Struct, frozen=True):
    """What the request path knows about a key: identity and limits (None = unlimited)."""

    id: str
    name: str
    allowed_models: list[str]
    rpm_limit: int | None
    tpm_limit: int | None
    max_parallel_requests: int | None
    token_budget: int | None
    budget_period: str | None
    expires_at: dt.datetime | None
    revoked: bool
    metadata: dict[str, Any]
    role: str = "member"
    max_budget_micros: int | None = None
    team: TeamLimits | None = None

    @property
    def team_id(self) -> str | None:
        return self.team.id if self.team is not None else None

    def allows_model(self, model: str) -> bool:
        if self.team is not None and self.team.allowed_models:
            if model not in self.team.allowed_models:
                return False
        return not self.allowed_models or model in self.allowed_models

    @classmethod
    def from_row(
        cls, row: ApiKey, team: Team | None = None, *, expires_at: dt.datetime | None = None
    ) -> ApiKeyRecord:
        return cls(
            id=str(row.id),
            name=row.name,
            allowed_models=list(row.allowed_models),
            rpm_limit=row.rpm_limit,
            tpm_limit=row.tpm_limit,
            max_parallel_requests=row.max_parallel_requests,
            token_budget=row.token_budget,
            budget_period=row.budget_period,
            expires_at=expires_at or row.expires_at,
            revoked=row.revoked_at is not None,
            metadata=dict(row.key_metadata),
            role=row.role,
            max_budget_micros=row.max_budget_micros,
            team=TeamLimits.from_row(team) if team is not None else None,
        )


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


async def provide_api_key(request: ASGIConnection[Any, Any, Any, Any]) -> ApiKeyRecord:
    """The caller's key record from ``Authorization: Bearer sk-...`` (a guard or dependency).

    Reads the KeyCache from ``app.state.key_cache``.
    """
    token = _presented_key(request.scope["headers"])
    if not token:
        raise AuthenticationFailed(
            "You didn't provide an API key. Send it as 'Authorization: Bearer sk-...' "
            "(or 'x-api-key: sk-...')."
        )
    cache: KeyCache = request.app.state.key_cache
    record = cache.cached(token)
    if record is not None:
        return record
    return await cache.lookup(token, client_address(request))


def _presented_key(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The bearer token, else ``x-api-key`` (Anthropic's clients send the key so), read from
    the ASGI headers as they are (lower-case names): no header map built per request."""
    authorization = api_key = None
    for name, value in headers:
        if name == b"authorization" and authorization is None:
            authorization = value
        elif name == b"x-api-key" and api_key is None:
            api_key = value
    if authorization is not None:
        token = bearer_token(authorization.decode("latin-1"))
        if token:
            return token
    return api_key.decode("latin-1") if api_key else None


def client_address(request: ASGIConnection[Any, Any, Any, Any]) -> str:
    """The caller's address: the first of ``client_address_header`` when one is configured
    (behind a proxy that sets it), else the peer's."""
    settings: Settings = request.app.state.settings
    if settings.client_address_header:
        forwarded = request.headers.get(settings.client_address_header)
        if forwarded:
            return forwarded.split(",", 1)[0].strip()
    return request.client.host if request.client else ""

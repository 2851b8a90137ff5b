"""API keys as the gateway holds them: generation, hashing, and the records of a key and its team.

A key is ``sk-`` plus 43 url-safe random characters; only its SHA-256 hex and a short display
prefix reach the database.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import re
import secrets
from typing import Any

import msgspec

from sluicegate.gateway.db.models import ApiKey, Team

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

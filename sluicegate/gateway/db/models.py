"""The gateway's tables: teams, API keys, prices, per-request usage, daily rollups, audit log.

``teams`` and ``api_keys`` use advanced_alchemy's UUID audit base (id, created_at, updated_at);
the usage tables have natural keys (request id; day+key+model) so they take the plain default
base. Money is integer micro-units of the gateway's currency (1 USD = 1_000_000), so sums are
exact; prices are micro-units per million tokens.
JSON columns are PostgreSQL JSONB directly: advanced_alchemy's JsonB type breaks on SQLAlchemy 2.1.
Every column here is mirrored by hand in ``migrations/versions``: change both together.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

from advanced_alchemy.base import DefaultBase, UUIDAuditBase
from advanced_alchemy.types import DateTimeUTC
from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Date,
    Double,
    ForeignKey,
    Identity,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    Uuid,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

BUDGET_PERIODS = ("day", "month")
USAGE_STATUSES = ("ok", "error", "cancelled")
ROLES = ("member", "team_admin")


class Team(UUIDAuditBase):
    """A group of keys whose limits and budgets bind the sum of its keys."""

    __tablename__ = "teams"
    __table_args__ = (
        CheckConstraint(
            "budget_period IS NULL OR budget_period IN ('day', 'month')", name="budget_period"
        ),
    )

    name: Mapped[str] = mapped_column(Text, unique=True)
    allowed_models: Mapped[list[str]] = mapped_column(JSONB, default=list)
    rpm_limit: Mapped[int | None] = mapped_column(Integer)
    tpm_limit: Mapped[int | None] = mapped_column(Integer)
    max_parallel_requests: Mapped[int | None] = mapped_column(Integer)
    token_budget: Mapped[int | None] = mapped_column(BigInteger)
    max_budget_micros: Mapped[int | None] = mapped_column(BigInteger)
    budget_period: Mapped[str | None] = mapped_column(String(8))
    team_metadata: Mapped[dict[str, Any]] = mapped_column("metadata", JSONB, default=dict)


class ApiKey(UUIDAuditBase):
    __tablename__ = "api_keys"
    __table_args__ = (
        CheckConstraint(
            "budget_period IS NULL OR budget_period IN ('day', 'month')", name="budget_period"
        ),
        CheckConstraint("role IN ('member', 'team_admin')", name="role"),
    )

    name: Mapped[str] = mapped_column(Text)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    """SHA-256 hex of the plaintext key; the plaintext itself is never stored."""
    key_prefix: Mapped[str] = mapped_column(String(16))
    """The first characters of the key, so people can tell their keys apart."""
    allowed_models: Mapped[list[str]] = mapped_column(JSONB, default=list)
    """Public model names this key may use; empty means every model."""
    rpm_limit: Mapped[int | None] = mapped_column(Integer)
    tpm_limit: Mapped[int | None] = mapped_column(Integer)
    max_parallel_requests: Mapped[int | None] = mapped_column(Integer)
    token_budget: Mapped[int | None] = mapped_column(BigInteger)
    budget_period: Mapped[str | None] = mapped_column(String(8))
    """``day`` or ``month`` (UTC calendar periods); NULL means the budget never resets."""
    expires_at: Mapped[dt.datetime | None] = mapped_column(DateTimeUTC(timezone=True))
    revoked_at: Mapped[dt.datetime | None] = mapped_column(DateTimeUTC(timezone=True))
    key_metadata: Mapped[dict[str, Any]] = mapped_column("metadata", JSONB, default=dict)
    team_id: Mapped[uuid.UUID | None] = mapped_column(
        Uuid, ForeignKey("teams.id", ondelete="RESTRICT"), index=True
    )
    role: Mapped[str] = mapped_column(String(16), default="member", server_default="member")
    """``member`` or ``team_admin`` (may manage its team's keys)."""
    max_budget_micros: Mapped[int | None] = mapped_column(BigInteger)
    previous_key_hash: Mapped[str | None] = mapped_column(String(64), index=True)
    """The hash a rotation replaced; it keeps working until ``previous_key_expires_at``."""
    previous_key_expires_at: Mapped[dt.datetime | None] = mapped_column(DateTimeUTC(timezone=True))


class ModelPrice(DefaultBase):
    """A model's price from ``effective_from`` on; earlier usage keeps the cost it was given."""

    __tablename__ = "model_prices"
    __table_args__ = (
        UniqueConstraint("model", "effective_from", name="uq_model_prices_model_effective"),
    )

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    model: Mapped[str] = mapped_column(Text)
    input_micros: Mapped[int] = mapped_column(BigInteger)
    cached_input_micros: Mapped[int] = mapped_column(BigInteger)
    output_micros: Mapped[int] = mapped_column(BigInteger)
    currency: Mapped[str] = mapped_column(String(3))
    effective_from: Mapped[dt.datetime] = mapped_column(DateTimeUTC(timezone=True))
    created_at: Mapped[dt.datetime] = mapped_column(DateTimeUTC(timezone=True))


class AuditEntry(DefaultBase):
    """One admin mutation, written in the transaction of the change itself."""

    __tablename__ = "audit_log"
    __table_args__ = (
        Index("ix_audit_log_at", "at"),
        Index("ix_audit_log_target", "target_type", "target_id"),
        Index("ix_audit_log_team_at", "team_id", "at"),
    )

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    at: Mapped[dt.datetime] = mapped_column(DateTimeUTC(timezone=True))
    actor: Mapped[str] = mapped_column(Text)
    """``master`` or ``key:<id>`` of the team admin."""
    actor_key_id: Mapped[uuid.UUID | None] = mapped_column(Uuid)
    action: Mapped[str] = mapped_column(Text)
    target_type: Mapped[str] = mapped_column(String(16))
    target_id: Mapped[str] = mapped_column(Text)
    team_id: Mapped[uuid.UUID | None] = mapped_column(Uuid)
    before: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    after: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    request_id: Mapped[str | None] = mapped_column(Text)


class UsageRecord(DefaultBase):
    """One finished request, written by the usage flusher, never on the request path."""

    __tablename__ = "usage_records"
    __table_args__ = (
        Index("ix_usage_records_key_finished", "key_id", "finished_at"),
        Index("ix_usage_records_model_finished", "model", "finished_at"),
        Index("ix_usage_records_finished", "finished_at"),
        Index("ix_usage_records_team_finished", "team_id", "finished_at"),
    )

    request_id: Mapped[str] = mapped_column(Text, primary_key=True)
    key_id: Mapped[uuid.UUID] = mapped_column(Uuid)
    model: Mapped[str] = mapped_column(Text)
    deployment: Mapped[str | None] = mapped_column(Text)
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    cost_micros: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    team_id: Mapped[uuid.UUID | None] = mapped_column(Uuid)
    status: Mapped[str] = mapped_column(String(16))
    finish_reason: Mapped[str | None] = mapped_column(Text)
    latency_ms: Mapped[float] = mapped_column(Double)
    ttft_ms: Mapped[float | None] = mapped_column(Double)
    started_at: Mapped[dt.datetime] = mapped_column(DateTimeUTC(timezone=True))
    finished_at: Mapped[dt.datetime] = mapped_column(DateTimeUTC(timezone=True))


class UsageDaily(DefaultBase):
    """Per UTC day, key and model totals; the admin usage queries read only this table."""

    __tablename__ = "usage_daily"
    __table_args__ = (
        Index("ix_usage_daily_key_day", "key_id", "day"),
        Index("ix_usage_daily_team_day", "team_id", "day"),
    )

    day: Mapped[dt.date] = mapped_column(Date, primary_key=True)
    key_id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True)
    model: Mapped[str] = mapped_column(Text, primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)
    cost_micros: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    errors: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    team_id: Mapped[uuid.UUID | None] = mapped_column(Uuid)
    """The key's team when the requests were made."""


metadata = ApiKey.metadata

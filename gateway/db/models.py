"""The gateway's tables: API keys, one row per request's usage, and daily rollups.

``api_keys`` uses advanced_alchemy's UUID audit base (id, created_at, updated_at); the usage
tables have natural keys (request id; day+key+model) so they take the plain default base.
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
    Index,
    Integer,
    String,
    Text,
    Uuid,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

BUDGET_PERIODS = ("day", "month")
USAGE_STATUSES = ("ok", "error", "cancelled")


class ApiKey(UUIDAuditBase):
    __tablename__ = "api_keys"
    __table_args__ = (
        CheckConstraint(
            "budget_period IS NULL OR budget_period IN ('day', 'month')", name="budget_period"
        ),
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


class UsageRecord(DefaultBase):
    """One finished request, written by the usage flusher, never on the request path."""

    __tablename__ = "usage_records"
    __table_args__ = (
        Index("ix_usage_records_key_finished", "key_id", "finished_at"),
        Index("ix_usage_records_model_finished", "model", "finished_at"),
        Index("ix_usage_records_finished", "finished_at"),
    )

    request_id: Mapped[str] = mapped_column(Text, primary_key=True)
    key_id: Mapped[uuid.UUID] = mapped_column(Uuid)
    model: Mapped[str] = mapped_column(Text)
    deployment: Mapped[str | None] = mapped_column(Text)
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16))
    finish_reason: Mapped[str | None] = mapped_column(Text)
    latency_ms: Mapped[float] = mapped_column(Double)
    ttft_ms: Mapped[float | None] = mapped_column(Double)
    started_at: Mapped[dt.datetime] = mapped_column(DateTimeUTC(timezone=True))
    finished_at: Mapped[dt.datetime] = mapped_column(DateTimeUTC(timezone=True))


class UsageDaily(DefaultBase):
    """Per UTC day, key and model totals; the admin usage queries read only this table."""

    __tablename__ = "usage_daily"
    __table_args__ = (Index("ix_usage_daily_key_day", "key_id", "day"),)

    day: Mapped[dt.date] = mapped_column(Date, primary_key=True)
    key_id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True)
    model: Mapped[str] = mapped_column(Text, primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)


metadata = ApiKey.metadata

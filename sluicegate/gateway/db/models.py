"""The gateway's tables: teams, API keys, prices, LoRA adapters, per-request usage, daily
rollups, audit log, stored Responses.

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
    PrimaryKeyConstraint,
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


class LoraAdapterRow(DefaultBase):
    """A LoRA adapter on a base model, called as ``base_model:name``; global (``team_id``
    NULL, registered by the master key) or its team's alone. Prices are micro-units per
    million tokens; NULL: the base model's price applies."""

    __tablename__ = "lora_adapters"
    __table_args__ = (
        UniqueConstraint("base_model", "name", name="uq_lora_adapters_base_model_name"),
        CheckConstraint("(input_micros IS NULL) = (output_micros IS NULL)", name="price"),
    )

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    name: Mapped[str] = mapped_column(Text)
    base_model: Mapped[str] = mapped_column(Text)
    path: Mapped[str] = mapped_column(Text)
    """The peft folder on the workers' filesystem."""
    team_id: Mapped[uuid.UUID | None] = mapped_column(
        Uuid, ForeignKey("teams.id", ondelete="RESTRICT")
    )
    input_micros: Mapped[int | None] = mapped_column(BigInteger)
    cached_input_micros: Mapped[int | None] = mapped_column(BigInteger)
    output_micros: Mapped[int | None] = mapped_column(BigInteger)
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
    """One finished request, written by the usage flusher, never on the request path.

    No report reads this table (they read the rollups), so it carries only the indexes its
    writers and its pruner read: the primary key (the flusher's ``ON CONFLICT`` and its
    corrections) and ``finished_at`` (retention's oldest-first batches). Revision 0003 dropped
    (key_id, finished_at), (model, finished_at) and (team_id, finished_at), which no query read
    and every insert paid for.
    """

    __tablename__ = "usage_records"
    __table_args__ = (
        # Read by delete_usage_records_before (SLUICEGATE_USAGE_RETENTION_DAYS).
        Index("ix_usage_records_finished", "finished_at"),
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
    adapter: Mapped[str | None] = mapped_column(Text)
    """The LoRA adapter the request ran with (``base:name``); ``model`` is what was called."""


class UsageDaily(DefaultBase):
    """Per UTC day, key and model totals: the rollup the flusher writes, and the one the
    coarser rollups below are derived from (see UsageRollupChange)."""

    __tablename__ = "usage_daily"
    __table_args__ = (
        # Model before key (revision 0003): a model's rows of a day are one range of the key,
        # which the days at the edges of a by-key report of one model read; and the CSV
        # export's order (day, model, key) is the key's.
        PrimaryKeyConstraint("day", "model", "key_id", name="pk_usage_daily"),
        # A key's reports and budget (any range, any grouping).
        Index("ix_usage_daily_key_day", "key_id", "day"),
        # A team's CSV export.
        Index("ix_usage_daily_team_day", "team_id", "day"),
    )

    day: Mapped[dt.date] = mapped_column(Date)
    key_id: Mapped[uuid.UUID] = mapped_column(Uuid)
    model: Mapped[str] = mapped_column(Text)
    requests: Mapped[int] = mapped_column(BigInteger)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)
    cost_micros: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    errors: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    team_id: Mapped[uuid.UUID | None] = mapped_column(Uuid)
    """The key's team when the requests were made."""


NO_TEAM = uuid.UUID(int=0)
"""``team_id`` of the derived rollups' rows of keys in no team: a key column cannot be NULL."""


ROLLUP_SUMS = ("requests", "prompt_tokens", "completion_tokens", "cost_micros", "errors")


class _RollupTotals:
    """The sums every derived rollup row carries, and how many ``usage_daily`` rows it sums."""

    requests: Mapped[int] = mapped_column(BigInteger)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)
    cost_micros: Mapped[int] = mapped_column(BigInteger)
    errors: Mapped[int] = mapped_column(BigInteger)
    source_rows: Mapped[int] = mapped_column(BigInteger)
    """A fold deletes the row when this reaches 0 (its ``usage_daily`` rows moved to another
    team or were deleted); reports skip groups that sum to 0 rows with the pending changes."""


# Coarser rollups of usage_daily. Each one, plus the changes in usage_rollup_changes not yet
# folded into it, is exactly ``SELECT <its key>, sum(...) FROM usage_daily GROUP BY <its key>``
# (team_id: NO_TEAM for NULL): see UsageRollupChange. At 1,000 keys x 10 models x 730 days
# (7.3M usage_daily rows) a report reads at most tens of thousands of their rows instead of
# millions: see sluicegate.gateway.db.usage_sources for which query reads which. All but usage_monthly
# are stored at fillfactor 50 (set by the migration): the current day's and month's rows are
# rewritten by every fold, and the room lets those updates stay on their page (HOT: no index
# writes).


class UsageDailyKey(_RollupTotals, DefaultBase):
    """Per UTC day, team and key (all models)."""

    __tablename__ = "usage_daily_keys"
    __table_args__ = (
        PrimaryKeyConstraint("day", "team_id", "key_id", name="pk_usage_daily_keys"),
        Index("ix_usage_daily_keys_team_day", "team_id", "day"),
    )

    day: Mapped[dt.date] = mapped_column(Date)
    team_id: Mapped[uuid.UUID] = mapped_column(Uuid)
    key_id: Mapped[uuid.UUID] = mapped_column(Uuid)


class UsageDailyModel(_RollupTotals, DefaultBase):
    """Per team, model and UTC day (all the team's keys)."""

    __tablename__ = "usage_daily_models"
    __table_args__ = (
        # Team first: a team's reports, and its models in use (a skip scan over this key).
        PrimaryKeyConstraint("team_id", "model", "day", name="pk_usage_daily_models"),
        Index("ix_usage_daily_models_model_day", "model", "day"),
    )

    team_id: Mapped[uuid.UUID] = mapped_column(Uuid)
    model: Mapped[str] = mapped_column(Text)
    day: Mapped[dt.date] = mapped_column(Date)


class UsageDailyTotal(_RollupTotals, DefaultBase):
    """Per model and UTC day (every key): the reports over all keys, and the models in use."""

    __tablename__ = "usage_daily_totals"
    __table_args__ = (PrimaryKeyConstraint("model", "day", name="pk_usage_daily_totals"),)

    model: Mapped[str] = mapped_column(Text)
    day: Mapped[dt.date] = mapped_column(Date)


class UsageMonthly(_RollupTotals, DefaultBase):
    """Per UTC month (its first day), team, key and model: by-key reports of one model.

    Read only by model, so the key starts with it and carries the sums (INCLUDE): a model's
    rows are one index range read without the heap, where they would be scattered over every
    page of the table (25k rows of one model on 7.8k pages at the bench's size).
    """

    __tablename__ = "usage_monthly"
    __table_args__ = (
        PrimaryKeyConstraint(
            "model",
            "month",
            "team_id",
            "key_id",
            name="pk_usage_monthly",
            postgresql_include=[*ROLLUP_SUMS, "source_rows"],
        ),
    )

    month: Mapped[dt.date] = mapped_column(Date)
    team_id: Mapped[uuid.UUID] = mapped_column(Uuid)
    key_id: Mapped[uuid.UUID] = mapped_column(Uuid)
    model: Mapped[str] = mapped_column(Text)


class UsageMonthlyKey(_RollupTotals, DefaultBase):
    """Per UTC month (its first day), team and key: by-key and by-team reports."""

    __tablename__ = "usage_monthly_keys"
    __table_args__ = (
        PrimaryKeyConstraint("month", "team_id", "key_id", name="pk_usage_monthly_keys"),
        Index("ix_usage_monthly_keys_team_month", "team_id", "month"),
    )

    month: Mapped[dt.date] = mapped_column(Date)
    team_id: Mapped[uuid.UUID] = mapped_column(Uuid)
    key_id: Mapped[uuid.UUID] = mapped_column(Uuid)


class UsageRollupChange(DefaultBase):
    """A change to usage_daily not yet added to the rollups derived from it.

    Statement triggers on usage_daily (revision 0003) append each statement's change here at
    usage_daily's grain (new rows minus old, so a row that moved teams is -old and +new), in
    the writer's transaction: the flusher's batch pays one small insert instead of updating
    five rollups. ``fold_usage_rollups`` moves the changes into the rollups in the background,
    many batches at once (today's rows, which every batch touches, once); until then every
    report reads them beside the rollups, so the sum of the two is always exact.
    """

    __tablename__ = "usage_rollup_changes"

    id: Mapped[int] = mapped_column(BigInteger, Identity(), primary_key=True)
    day: Mapped[dt.date] = mapped_column(Date)
    key_id: Mapped[uuid.UUID] = mapped_column(Uuid)
    model: Mapped[str] = mapped_column(Text)
    team_id: Mapped[uuid.UUID | None] = mapped_column(Uuid)
    requests: Mapped[int] = mapped_column(BigInteger)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)
    cost_micros: Mapped[int] = mapped_column(BigInteger)
    errors: Mapped[int] = mapped_column(BigInteger)
    source_rows: Mapped[int] = mapped_column(BigInteger)
    """usage_daily rows added (+1), removed (-1) or moved between groups by the change."""


class StoredResponse(DefaultBase):
    """A Responses API response kept for ``previous_response_id`` and the ``/v1/responses/{id}``
    routes (``sluicegate.gateway.stored``); visible to its owner's team, or to the key alone
    when the key is in no team."""

    __tablename__ = "stored_responses"
    __table_args__ = (
        # Read by delete_responses_before (SLUICEGATE_RESPONSE_RETENTION_DAYS).
        Index("ix_stored_responses_created", "created_at"),
    )

    id: Mapped[str] = mapped_column(Text, primary_key=True)
    key_id: Mapped[uuid.UUID] = mapped_column(Uuid)
    team_id: Mapped[uuid.UUID | None] = mapped_column(Uuid)
    """The key's team when the response was made: the team that may read it."""
    created_at: Mapped[dt.datetime] = mapped_column(DateTimeUTC(timezone=True))
    response: Mapped[dict[str, Any]] = mapped_column(JSONB)
    """The response object as the client got it (the last event of a stream)."""
    input_items: Mapped[list[dict[str, Any]]] = mapped_column(JSONB)
    """Every item the model read, each with an ``id``: the input items and output of the
    responses this one continued (``previous_response_id``, oldest first), then its own input.
    Whole here, so that a chain reads one row however long it is, and outlives the deletion of
    the responses it continued."""


metadata = ApiKey.metadata

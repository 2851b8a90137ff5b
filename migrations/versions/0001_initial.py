"""API keys, usage records and daily usage rollups.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("key_hash", sa.String(64), nullable=False),
        sa.Column("key_prefix", sa.String(16), nullable=False),
        sa.Column("allowed_models", postgresql.JSONB(), nullable=False),
        sa.Column("rpm_limit", sa.Integer(), nullable=True),
        sa.Column("tpm_limit", sa.Integer(), nullable=True),
        sa.Column("max_parallel_requests", sa.Integer(), nullable=True),
        sa.Column("token_budget", sa.BigInteger(), nullable=True),
        sa.Column("budget_period", sa.String(8), nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("metadata", postgresql.JSONB(), nullable=False),
        sa.Column("sa_orm_sentinel", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_api_keys"),
        sa.UniqueConstraint("key_hash", name="uq_api_keys_key_hash"),
        sa.CheckConstraint(
            "budget_period IS NULL OR budget_period IN ('day', 'month')",
            name="ck_api_keys_budget_period",
        ),
    )
    op.create_table(
        "usage_records",
        sa.Column("request_id", sa.Text(), nullable=False),
        sa.Column("key_id", sa.Uuid(), nullable=False),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("deployment", sa.Text(), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("finish_reason", sa.Text(), nullable=True),
        sa.Column("latency_ms", sa.Double(), nullable=False),
        sa.Column("ttft_ms", sa.Double(), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("request_id", name="pk_usage_records"),
    )
    op.create_index("ix_usage_records_key_finished", "usage_records", ["key_id", "finished_at"])
    op.create_index("ix_usage_records_model_finished", "usage_records", ["model", "finished_at"])
    op.create_index("ix_usage_records_finished", "usage_records", ["finished_at"])
    op.create_table(
        "usage_daily",
        sa.Column("day", sa.Date(), nullable=False),
        sa.Column("key_id", sa.Uuid(), nullable=False),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("day", "key_id", "model", name="pk_usage_daily"),
    )
    op.create_index("ix_usage_daily_key_day", "usage_daily", ["key_id", "day"])


def downgrade() -> None:
    op.drop_index("ix_usage_daily_key_day", table_name="usage_daily")
    op.drop_table("usage_daily")
    op.drop_index("ix_usage_records_finished", table_name="usage_records")
    op.drop_index("ix_usage_records_model_finished", table_name="usage_records")
    op.drop_index("ix_usage_records_key_finished", table_name="usage_records")
    op.drop_table("usage_records")
    op.drop_table("api_keys")

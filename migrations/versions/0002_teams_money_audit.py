"""Teams, key roles and rotation, model prices, cost on usage, the audit log.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "teams",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("allowed_models", postgresql.JSONB(), nullable=False),
        sa.Column("rpm_limit", sa.Integer(), nullable=True),
        sa.Column("tpm_limit", sa.Integer(), nullable=True),
        sa.Column("max_parallel_requests", sa.Integer(), nullable=True),
        sa.Column("token_budget", sa.BigInteger(), nullable=True),
        sa.Column("max_budget_micros", sa.BigInteger(), nullable=True),
        sa.Column("budget_period", sa.String(8), nullable=True),
        sa.Column("metadata", postgresql.JSONB(), nullable=False),
        sa.Column("sa_orm_sentinel", sa.Integer(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_teams"),
        sa.UniqueConstraint("name", name="uq_teams_name"),
        sa.CheckConstraint(
            "budget_period IS NULL OR budget_period IN ('day', 'month')",
            name="ck_teams_budget_period",
        ),
    )
    op.add_column("api_keys", sa.Column("team_id", sa.Uuid(), nullable=True))
    op.add_column(
        "api_keys", sa.Column("role", sa.String(16), nullable=False, server_default="member")
    )
    op.add_column("api_keys", sa.Column("max_budget_micros", sa.BigInteger(), nullable=True))
    op.add_column("api_keys", sa.Column("previous_key_hash", sa.String(64), nullable=True))
    op.add_column(
        "api_keys",
        sa.Column("previous_key_expires_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_foreign_key(
        "fk_api_keys_team_id_teams", "api_keys", "teams", ["team_id"], ["id"], ondelete="RESTRICT"
    )
    op.create_check_constraint("ck_api_keys_role", "api_keys", "role IN ('member', 'team_admin')")
    op.create_index("ix_api_keys_team_id", "api_keys", ["team_id"])
    op.create_index("ix_api_keys_previous_key_hash", "api_keys", ["previous_key_hash"])

    op.create_table(
        "model_prices",
        sa.Column("id", sa.BigInteger(), sa.Identity(), nullable=False),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("input_micros", sa.BigInteger(), nullable=False),
        sa.Column("cached_input_micros", sa.BigInteger(), nullable=False),
        sa.Column("output_micros", sa.BigInteger(), nullable=False),
        sa.Column("currency", sa.String(3), nullable=False),
        sa.Column("effective_from", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_model_prices"),
        sa.UniqueConstraint("model", "effective_from", name="uq_model_prices_model_effective"),
    )

    op.add_column(
        "usage_records",
        sa.Column("cost_micros", sa.BigInteger(), nullable=False, server_default="0"),
    )
    op.add_column("usage_records", sa.Column("team_id", sa.Uuid(), nullable=True))
    op.add_column(
        "usage_records",
        sa.Column("cached_tokens", sa.Integer(), nullable=False, server_default="0"),
    )
    op.create_index("ix_usage_records_team_finished", "usage_records", ["team_id", "finished_at"])
    op.add_column(
        "usage_daily",
        sa.Column("cost_micros", sa.BigInteger(), nullable=False, server_default="0"),
    )
    op.add_column(
        "usage_daily", sa.Column("errors", sa.BigInteger(), nullable=False, server_default="0")
    )
    op.add_column("usage_daily", sa.Column("team_id", sa.Uuid(), nullable=True))
    op.create_index("ix_usage_daily_team_day", "usage_daily", ["team_id", "day"])

    op.create_table(
        "audit_log",
        sa.Column("id", sa.BigInteger(), sa.Identity(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("actor", sa.Text(), nullable=False),
        sa.Column("actor_key_id", sa.Uuid(), nullable=True),
        sa.Column("action", sa.Text(), nullable=False),
        sa.Column("target_type", sa.String(16), nullable=False),
        sa.Column("target_id", sa.Text(), nullable=False),
        sa.Column("team_id", sa.Uuid(), nullable=True),
        sa.Column("before", postgresql.JSONB(), nullable=True),
        sa.Column("after", postgresql.JSONB(), nullable=True),
        sa.Column("request_id", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_audit_log"),
    )
    op.create_index("ix_audit_log_at", "audit_log", ["at"])
    op.create_index("ix_audit_log_target", "audit_log", ["target_type", "target_id"])
    op.create_index("ix_audit_log_team_at", "audit_log", ["team_id", "at"])


def downgrade() -> None:
    op.drop_table("audit_log")
    op.drop_index("ix_usage_daily_team_day", table_name="usage_daily")
    op.drop_column("usage_daily", "team_id")
    op.drop_column("usage_daily", "errors")
    op.drop_column("usage_daily", "cost_micros")
    op.drop_index("ix_usage_records_team_finished", table_name="usage_records")
    op.drop_column("usage_records", "cached_tokens")
    op.drop_column("usage_records", "team_id")
    op.drop_column("usage_records", "cost_micros")
    op.drop_table("model_prices")
    op.drop_index("ix_api_keys_previous_key_hash", table_name="api_keys")
    op.drop_index("ix_api_keys_team_id", table_name="api_keys")
    op.drop_constraint("ck_api_keys_role", "api_keys", type_="check")
    op.drop_constraint("fk_api_keys_team_id_teams", "api_keys", type_="foreignkey")
    for column in ("previous_key_expires_at", "previous_key_hash", "max_budget_micros", "role"):
        op.drop_column("api_keys", column)
    op.drop_column("api_keys", "team_id")
    op.drop_table("teams")

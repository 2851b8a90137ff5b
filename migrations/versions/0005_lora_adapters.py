"""LoRA adapters as models: the adapter registry, and the adapter on each usage record.

An adapter is served by the engine workers of its base model and called as ``base:name``.
``team_id`` NULL is a global adapter (registered by the master key); otherwise only that
team's keys see it. Prices are micro-units per million tokens like ``model_prices``; NULL
means the base model's price applies. ``usage_records.adapter`` names the adapter a request
ran with (``base:name``), while ``model`` stays the name the client called, which is what the
rollups group by.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "lora_adapters",
        sa.Column("id", sa.Uuid(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("base_model", sa.Text(), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("team_id", sa.Uuid(), nullable=True),
        sa.Column("input_micros", sa.BigInteger(), nullable=True),
        sa.Column("cached_input_micros", sa.BigInteger(), nullable=True),
        sa.Column("output_micros", sa.BigInteger(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["team_id"],
            ["teams.id"],
            name="fk_lora_adapters_team_id_teams",
            ondelete="RESTRICT",
        ),
        sa.PrimaryKeyConstraint("id", name="pk_lora_adapters"),
        sa.UniqueConstraint("base_model", "name", name="uq_lora_adapters_base_model_name"),
        sa.CheckConstraint(
            "(input_micros IS NULL) = (output_micros IS NULL)", name="ck_lora_adapters_price"
        ),
    )
    op.add_column("usage_records", sa.Column("adapter", sa.Text(), nullable=True))


def downgrade() -> None:
    op.drop_column("usage_records", "adapter")
    op.drop_table("lora_adapters")

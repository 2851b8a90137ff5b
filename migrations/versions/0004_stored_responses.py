"""Stored Responses: ``POST /v1/responses`` with ``store`` (OpenAI's default) keeps the response.

One row per stored response: the response object as the client got it, and every input item
the model saw for it (the items of the responses it continued, then the request's own), so
that ``previous_response_id`` and ``GET /v1/responses/{id}/input_items`` read one row by its
key. Visible to the owner's team (or, for a key in no team, to that key alone). Rows older than
SLUICEGATE_RESPONSE_RETENTION_DAYS are deleted oldest first, through ``created_at``'s index.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "stored_responses",
        sa.Column("id", sa.Text(), nullable=False),
        sa.Column("key_id", sa.Uuid(), nullable=False),
        sa.Column("team_id", sa.Uuid(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("response", postgresql.JSONB(), nullable=False),
        sa.Column("input_items", postgresql.JSONB(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_stored_responses"),
    )
    op.create_index("ix_stored_responses_created", "stored_responses", ["created_at"])


def downgrade() -> None:
    op.drop_table("stored_responses")

"""The Batch API: files, batches and their lines (``sluicegate.gateway.batches``).

Files hold their bytes in ``content`` unless the S3 store keeps them. A line is claimed by a
replica (``claimed_by``, ``claim_expires_at``) and settled with its result only while the claim
is held, so a replica that dies mid-batch leaves its lines to be claimed again, never run twice
into the output.

Revision ID: 0006
Revises: 0004
Create Date: 2026-12-06
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def _when(name: str, nullable: bool = True) -> sa.Column[sa.DateTime]:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "batch_files",
        sa.Column("id", sa.Text(), nullable=False),
        sa.Column("key_id", sa.Uuid(), nullable=False),
        sa.Column("team_id", sa.Uuid(), nullable=True),
        sa.Column("purpose", sa.Text(), nullable=False),
        sa.Column("filename", sa.Text(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        _when("created_at", nullable=False),
        sa.Column("store", sa.Text(), nullable=False),
        sa.Column("content", sa.LargeBinary(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_batch_files"),
    )
    op.create_index("ix_batch_files_owner", "batch_files", ["team_id", "key_id", "created_at"])
    op.create_table(
        "batches",
        sa.Column("id", sa.Text(), nullable=False),
        sa.Column("api", sa.Text(), nullable=False),
        sa.Column("key_id", sa.Uuid(), nullable=False),
        sa.Column("team_id", sa.Uuid(), nullable=True),
        sa.Column("endpoint", sa.Text(), nullable=False),
        sa.Column("input_file_id", sa.Text(), nullable=True),
        sa.Column("completion_window", sa.Text(), nullable=False),
        sa.Column("status", sa.Text(), nullable=False),
        sa.Column("output_file_id", sa.Text(), nullable=True),
        sa.Column("error_file_id", sa.Text(), nullable=True),
        sa.Column("metadata", postgresql.JSONB(), nullable=True),
        sa.Column("errors", postgresql.JSONB(), nullable=True),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("succeeded", sa.Integer(), nullable=False),
        sa.Column("failed", sa.Integer(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cost_micros", sa.BigInteger(), nullable=False),
        _when("created_at", nullable=False),
        _when("expires_at", nullable=False),
        _when("in_progress_at"),
        _when("cancelling_at"),
        _when("ended_at"),
        sa.PrimaryKeyConstraint("id", name="pk_batches"),
    )
    op.create_index("ix_batches_status", "batches", ["status"])
    op.create_index("ix_batches_owner", "batches", ["team_id", "key_id", "created_at"])
    op.create_table(
        "batch_lines",
        sa.Column("batch_id", sa.Text(), nullable=False),
        sa.Column("line", sa.Integer(), nullable=False),
        sa.Column("custom_id", sa.Text(), nullable=False),
        sa.Column("body", postgresql.JSONB(), nullable=False),
        sa.Column("state", sa.Text(), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("claimed_by", sa.Text(), nullable=True),
        _when("claim_expires_at"),
        sa.Column("request_id", sa.Text(), nullable=True),
        sa.Column("status_code", sa.Integer(), nullable=True),
        sa.Column("response", postgresql.JSONB(), nullable=True),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("batch_id", "line", name="pk_batch_lines"),
    )
    op.create_index("ix_batch_lines_state", "batch_lines", ["state", "claim_expires_at"])


def downgrade() -> None:
    op.drop_table("batch_lines")
    op.drop_table("batches")
    op.drop_table("batch_files")

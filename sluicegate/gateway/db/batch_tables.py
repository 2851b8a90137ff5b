"""The Batch API's tables: uploaded files, batches and their lines (``sluicegate.gateway.batches``).

A line is the unit of work and of crash safety: a runner claims it (``state`` running,
``claimed_by`` its replica, ``claim_expires_at`` renewed while it runs), runs it as a live
request of the batch's key, and settles it (``state`` done with its result) only while it still
holds the claim. A claim that lapsed (its replica died) is taken again by any replica, so every
line ends exactly once. Mirrored by hand in ``migrations/versions/0006_batches.py``.
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

from advanced_alchemy.base import DefaultBase
from advanced_alchemy.types import DateTimeUTC
from sqlalchemy import BigInteger, Index, Integer, LargeBinary, PrimaryKeyConstraint, Text, Uuid
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column


class BatchFile(DefaultBase):
    """An uploaded or produced file; its bytes here (``content``) or in the S3 store."""

    __tablename__ = "batch_files"
    __table_args__ = (Index("ix_batch_files_owner", "team_id", "key_id", "created_at"),)

    id: Mapped[str] = mapped_column(Text, primary_key=True)
    key_id: Mapped[uuid.UUID] = mapped_column(Uuid)
    team_id: Mapped[uuid.UUID | None] = mapped_column(Uuid)
    purpose: Mapped[str] = mapped_column(Text)
    filename: Mapped[str] = mapped_column(Text)
    size: Mapped[int] = mapped_column("bytes", BigInteger)
    created_at: Mapped[dt.datetime] = mapped_column(DateTimeUTC(timezone=True))
    store: Mapped[str] = mapped_column(Text)
    """``postgres`` (the bytes are in ``content``) or ``s3``."""
    content: Mapped[bytes | None] = mapped_column(LargeBinary)


class Batch(DefaultBase):
    """One batch, OpenAI's (``api`` openai) or Anthropic's (``api`` anthropic)."""

    __tablename__ = "batches"
    __table_args__ = (
        Index("ix_batches_status", "status"),
        Index("ix_batches_owner", "team_id", "key_id", "created_at"),
    )

    id: Mapped[str] = mapped_column(Text, primary_key=True)
    api: Mapped[str] = mapped_column(Text)
    key_id: Mapped[uuid.UUID] = mapped_column(Uuid)
    team_id: Mapped[uuid.UUID | None] = mapped_column(Uuid)
    endpoint: Mapped[str] = mapped_column(Text)
    input_file_id: Mapped[str | None] = mapped_column(Text)
    completion_window: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(Text)
    output_file_id: Mapped[str | None] = mapped_column(Text)
    error_file_id: Mapped[str | None] = mapped_column(Text)
    batch_metadata: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSONB)
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(JSONB)
    total: Mapped[int] = mapped_column(Integer)
    succeeded: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cost_micros: Mapped[int] = mapped_column(BigInteger, default=0)
    created_at: Mapped[dt.datetime] = mapped_column(DateTimeUTC(timezone=True))
    expires_at: Mapped[dt.datetime] = mapped_column(DateTimeUTC(timezone=True))
    in_progress_at: Mapped[dt.datetime | None] = mapped_column(DateTimeUTC(timezone=True))
    cancelling_at: Mapped[dt.datetime | None] = mapped_column(DateTimeUTC(timezone=True))
    ended_at: Mapped[dt.datetime | None] = mapped_column(DateTimeUTC(timezone=True))
    """When it became completed, failed, expired or cancelled (``status`` says which)."""


class BatchLine(DefaultBase):
    """One request of a batch, from pending through running to done."""

    __tablename__ = "batch_lines"
    __table_args__ = (
        PrimaryKeyConstraint("batch_id", "line", name="pk_batch_lines"),
        Index("ix_batch_lines_state", "state", "claim_expires_at"),
    )

    batch_id: Mapped[str] = mapped_column(Text)
    line: Mapped[int] = mapped_column(Integer)
    custom_id: Mapped[str] = mapped_column(Text)
    body: Mapped[dict[str, Any]] = mapped_column(JSONB)
    state: Mapped[str] = mapped_column(Text)
    """pending, running, done (a result) or skipped (cancelled or expired before it ran)."""
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    claimed_by: Mapped[str | None] = mapped_column(Text)
    claim_expires_at: Mapped[dt.datetime | None] = mapped_column(DateTimeUTC(timezone=True))
    request_id: Mapped[str | None] = mapped_column(Text)
    status_code: Mapped[int | None] = mapped_column(Integer)
    response: Mapped[dict[str, Any] | None] = mapped_column(JSONB)
    """The body the endpoint answered (its error object when ``status_code`` is not 2xx)."""
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)

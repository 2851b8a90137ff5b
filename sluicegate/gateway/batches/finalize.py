"""Ending a batch: once no line is pending or running, its output and error files are written
(OpenAI's) and its status becomes completed, cancelled or expired, in one transaction.

The batch row is locked with ``SKIP LOCKED``: of the replicas that see a batch ready at once,
one ends it and the others move on; a replica that dies while ending one leaves it unchanged
for the next sweep. Past its window, a batch's pending lines are skipped (expired); once
cancelled, so are the running lines whose claim lapsed, as their replica is gone.
"""

from __future__ import annotations

import os
from typing import Any

import msgspec
from sqlalchemy import select, text, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluicegate.gateway.batches.file_store import FileStore
from sluicegate.gateway.batches.queries import ENDED, utcnow
from sluicegate.gateway.batches.wire import openai_result
from sluicegate.gateway.db.batch_tables import Batch, BatchFile, BatchLine

_READY = text(
    """
    SELECT b.id FROM batches b
    WHERE b.status IN ('in_progress', 'cancelling')
      AND (b.expires_at <= now() OR b.status = 'cancelling' OR NOT EXISTS (
          SELECT 1 FROM batch_lines l
          WHERE l.batch_id = b.id AND l.state IN ('pending', 'running')))
    LIMIT 100
    """
)
_SKIP_EXPIRED = text(
    """
    UPDATE batch_lines SET state = 'skipped'
    WHERE batch_id = :batch_id
      AND (state = 'pending' OR (state = 'running' AND claim_expires_at < now()))
    """
)
_SKIP_ABANDONED = text(
    """
    UPDATE batch_lines SET state = 'skipped'
    WHERE batch_id = :batch_id AND state = 'running' AND claim_expires_at < now()
    """
)
_UNFINISHED = text(
    "SELECT count(*) FROM batch_lines WHERE batch_id = :batch_id AND state IN ('pending', 'running')"
)


async def ready_batches(sessionmaker: async_sessionmaker[AsyncSession]) -> list[str]:
    """Batches that may be ready to end (each is checked again under its lock)."""
    async with sessionmaker() as session:
        return [row[0] for row in await session.execute(_READY)]


async def finalize(
    sessionmaker: async_sessionmaker[AsyncSession], files: FileStore, batch_id: str
) -> bool:
    """End the batch if nothing of it is left to run; whether this call ended it."""
    async with sessionmaker() as session, session.begin():
        query = select(Batch).where(Batch.id == batch_id).with_for_update(skip_locked=True)
        batch = (await session.execute(query)).scalar()
        if batch is None or batch.status in ENDED:
            return False
        now = utcnow()
        if batch.status == "in_progress" and batch.expires_at <= now:
            ending = "expired"
            await session.execute(_SKIP_EXPIRED, {"batch_id": batch_id})
        elif batch.status == "cancelling":
            ending = "cancelled"
            await session.execute(_SKIP_ABANDONED, {"batch_id": batch_id})
        else:
            ending = "completed"
        if (await session.execute(_UNFINISHED, {"batch_id": batch_id})).scalar():
            return False
        batch.status = ending
        if batch.api == "openai":
            await _write_files(session, files, batch)
        await session.execute(
            update(Batch)
            .where(Batch.id == batch_id)
            .values(
                status=ending,
                ended_at=now,
                output_file_id=batch.output_file_id,
                error_file_id=batch.error_file_id,
            )
        )
    return True


async def _write_files(session: AsyncSession, files: FileStore, batch: Batch) -> None:
    lines = await session.execute(
        select(BatchLine).where(BatchLine.batch_id == batch.id).order_by(BatchLine.line)
    )
    output: list[bytes] = []
    errors: list[bytes] = []
    for line in lines.scalars():
        succeeded, result = openai_result(batch, line)
        (output if succeeded else errors).append(msgspec.json.encode(result) + b"\n")
    if output:
        batch.output_file_id = await _store(session, files, batch, "output", output)
    if errors:
        batch.error_file_id = await _store(session, files, batch, "error", errors)


async def _store(
    session: AsyncSession, files: FileStore, batch: Batch, kind: str, lines: list[Any]
) -> str:
    file_id = "file-" + os.urandom(12).hex()
    content = b"".join(lines)
    session.add(
        BatchFile(
            id=file_id,
            key_id=batch.key_id,
            team_id=batch.team_id,
            purpose="batch_output",
            filename=f"{batch.id}_{kind}.jsonl",
            size=len(content),
            created_at=utcnow(),
            store=files.name,
            content=await files.put(file_id, content),
        )
    )
    await session.flush()
    return file_id

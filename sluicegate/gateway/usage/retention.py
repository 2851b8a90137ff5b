"""Retention of per-request usage records (``SLUICEGATE_USAGE_RETENTION_DAYS``).

``usage_records`` grows by a row per request forever; no report reads it (they read the
rollups, which keep every total), so a deployment may keep only the recent requests. Every
replica that runs a usage flusher also runs this pruner: it deletes the records finished
before 00:00 UTC ``days`` days ago, oldest first, in batches of ``batch`` rows, each its own
short transaction with a pause after it, so neither a lock nor a burst of WAL is ever large;
then it sleeps ``interval_s``. Several pruners at once split the work (``SKIP LOCKED``).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluicegate.gateway.db.usage_upkeep import delete_usage_records_before

logger = logging.getLogger(__name__)

BATCH = 5000
"""Records one delete statement removes (about 30 ms at 10M records)."""
INTERVAL_S = 600.0
"""Sleep between passes: the cutoff moves a day a day, so the pace only bounds the backlog."""
PAUSE_S = 0.1
"""Between batches of one pass: the flushers' own writes get the database in between."""


class UsageRetention:
    label = "usage retention"
    """Names the pruner in its task and log lines (a subclass prunes another table)."""

    def __init__(
        self,
        sessionmaker: async_sessionmaker[AsyncSession],
        days: int,
        *,
        batch: int = BATCH,
        interval_s: float = INTERVAL_S,
        pause_s: float = PAUSE_S,
    ) -> None:
        if days <= 0:
            raise ValueError("retention needs a window of at least one day")
        self._sessionmaker = sessionmaker
        self.days = days
        self._batch = batch
        self._interval_s = interval_s
        self._pause_s = pause_s
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.deleted = 0
        """Records this pruner deleted."""

    def cutoff(self, now: dt.datetime) -> dt.datetime:
        """Records finished before this go: whole UTC days, ``days`` of them before today."""
        first_kept = now.astimezone(dt.UTC).date() - dt.timedelta(days=self.days)
        return dt.datetime.combine(first_kept, dt.time(), dt.UTC)

    async def prune(self, now: dt.datetime | None = None) -> int:
        """One pass: batch after batch until none is full (or asked to stop); how many went."""
        cutoff = self.cutoff(now or dt.datetime.now(dt.UTC))
        deleted = 0
        while True:
            async with self._sessionmaker() as session, session.begin():
                count = await self.delete_before(session, cutoff, self._batch)
            deleted += count
            self.deleted += count
            if count < self._batch or self._stopping.is_set():
                break
            await self._wait(self._pause_s)
        if deleted:
            logger.info("%s: deleted %d rows from before %s", self.label, deleted, cutoff)
        return deleted

    async def delete_before(self, session: AsyncSession, cutoff: dt.datetime, limit: int) -> int:
        """One batch, in the caller's transaction: how many rows went."""
        return await delete_usage_records_before(session, cutoff, limit)

    async def start(self) -> None:
        self._stopping.clear()
        self._task = asyncio.create_task(self.run(), name=self.label.replace(" ", "-"))

    async def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping.set()
        if self._task is None:
            return
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(self._task, timeout_s)
        self._task = None

    async def run(self) -> None:
        while not self._stopping.is_set():
            try:
                await self.prune()
            except Exception as exc:
                # A database outage or a lock timeout: the next pass picks up where this left.
                logger.warning("%s: %s: %s; retrying later", self.label, type(exc).__name__, exc)
            await self._wait(self._interval_s)

    async def _wait(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

"""Usage accounting behind the request path: one XADD per request, a flusher into PostgreSQL.

``UsageRecorder.record`` appends the event to the Redis stream ``settings.usage_stream``; no
request waits on the database. ``UsageFlusher`` (any replica, several at once) reads the
stream through the consumer group ``usage-flushers``, writes each batch in one transaction
(idempotent on request id, see ``sluicegate.gateway.db.usage.insert_usage``), and XACKs + XDELs only
after the commit. While PostgreSQL is down it keeps retrying the same batch with backoff, so
records are delayed, never lost; entries left pending by a flusher that died are taken over
with XAUTOCLAIM once idle for ``claim_idle_s``. Every ``FOLD_INTERVAL_S`` a flusher also folds
the batches' pending rollup changes into the derived rollups (``fold_usage_rollups``; one
replica at a time, the others skip). With ``usage_retention_days`` set, each flusher also runs
the pruner of old records (``sluicegate.gateway.usage.retention``).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import os
import socket
import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal

import msgspec
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import RedisError, ResponseError
from sqlalchemy.exc import DataError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluicegate.gateway.db.usage import bills_more, insert_usage
from sluicegate.gateway.db.usage_upkeep import FOLD_LIMIT, fold_usage_rollups
from sluicegate.gateway.settings import Settings
from sluicegate.gateway.telemetry import USAGE_FLUSH_LAG
from sluicegate.gateway.usage.retention import UsageRetention

logger = logging.getLogger(__name__)

FLUSHER_GROUP = "usage-flushers"
EVENT_FIELD = b"e"
FOLD_INTERVAL_S = 1.0
"""Between folds: the batches of a second share one (today's rollup rows written once, not
per batch), and the pending changes every report reads stay a second's worth."""


class UsageEvent(msgspec.Struct, kw_only=True, frozen=True):
    """One finished request. Timestamps are Unix seconds (``time.time()``)."""

    request_id: str
    key_id: str
    model: str
    deployment: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cost_micros: int = 0
    """Exact cost in micro-units of the gateway's currency, priced at admission."""
    team_id: str | None = None
    status: Literal["ok", "error", "cancelled"] = "ok"
    finish_reason: str | None = None
    latency_ms: float = 0.0
    ttft_ms: float | None = None
    started_at: float
    finished_at: float
    adapter: str | None = None
    """The LoRA adapter the request ran with (``base:name``); ``model`` is the name called."""


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(UsageEvent)


class UsageRecorder:
    def __init__(self, redis: Redis, settings: Settings) -> None:
        self._redis = redis
        self._stream = settings.usage_stream

    async def record(self, event: UsageEvent) -> None:
        await self._redis.xadd(self._stream, {EVENT_FIELD: _encoder.encode(event)})

    def record_command(self, event: UsageEvent) -> tuple[Any, ...]:
        """The XADD of ``event``, for a caller that sends it with other commands."""
        return ("XADD", self._stream, "*", EVENT_FIELD, _encoder.encode(event))

    def record_in(self, pipeline: Pipeline, event: UsageEvent) -> None:
        """Queues the XADD on a pipeline the caller executes (e.g. with the limits settle)."""
        pipeline.xadd(self._stream, {EVENT_FIELD: _encoder.encode(event)})


def _row(event: UsageEvent) -> dict[str, Any]:
    return {
        "request_id": event.request_id,
        "key_id": uuid.UUID(event.key_id),
        "model": event.model,
        "deployment": event.deployment,
        "prompt_tokens": event.prompt_tokens,
        "completion_tokens": event.completion_tokens,
        "cached_tokens": event.cached_tokens,
        "cost_micros": event.cost_micros,
        "team_id": uuid.UUID(event.team_id) if event.team_id else None,
        "status": event.status,
        "finish_reason": event.finish_reason,
        "latency_ms": event.latency_ms,
        "ttft_ms": event.ttft_ms,
        "started_at": dt.datetime.fromtimestamp(event.started_at, dt.UTC),
        "finished_at": dt.datetime.fromtimestamp(event.finished_at, dt.UTC),
        "adapter": event.adapter,
    }


def _entry_time(entry_id: bytes | str) -> float:
    raw = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(raw.split("-", 1)[0]) / 1000.0


Entry = tuple[Any, dict[Any, Any]]


class UsageFlusher:
    def __init__(
        self,
        redis: Redis,
        sessionmaker: async_sessionmaker[AsyncSession],
        settings: Settings,
        *,
        consumer: str | None = None,
        claim_idle_s: float = 30.0,
        max_backoff_s: float = 5.0,
    ) -> None:
        self._redis = redis
        self._sessionmaker = sessionmaker
        self._stream = settings.usage_stream
        self._interval_s = settings.usage_flush_interval_s
        self._batch = settings.usage_flush_batch
        self.consumer = consumer or f"{socket.gethostname()}-{os.getpid()}-{settings.instance_id}"
        self._claim_idle_ms = int(claim_idle_s * 1000)
        self._claim_every_s = claim_idle_s / 2
        self._next_claim = 0.0
        self._next_fold = 0.0
        self._max_backoff_s = max_backoff_s
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.flushed = 0
        """Records this flusher inserted (not counting replays that were already stored)."""
        # Beside the flusher: every replica that writes usage records also prunes them, and
        # the app's lifespan starts and stops both as one.
        self.retention = (
            UsageRetention(sessionmaker, settings.usage_retention_days)
            if settings.usage_retention_days > 0
            else None
        )

    async def start(self) -> None:
        self._stopping.clear()
        with contextlib.suppress(RedisError):
            await self.ensure_group()  # else the loop keeps trying
        self._task = asyncio.create_task(self.run(), name=f"usage-flusher-{self.consumer}")
        if self.retention is not None:
            await self.retention.start()

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Finishes the batch in hand if the database allows within ``timeout_s``."""
        self._stopping.set()
        if self.retention is not None:
            await self.retention.stop(timeout_s)
        if self._task is None:
            return
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(self._task, timeout_s)
        self._task = None

    async def run(self) -> None:
        backoff_s = 0.05
        group_ready = False
        while not self._stopping.is_set():
            try:
                if not group_ready:
                    await self.ensure_group()
                    group_ready = True
                count = await self.flush_once()
                await self.fold_if_due()
                backoff_s = 0.05
            except Exception as exc:
                # NOGROUP (the stream was deleted), a lost Redis, or a bug: the flusher must
                # outlive it, and the entries stay pending until a later pass commits them.
                group_ready = False
                logger.warning("usage flusher: %s: %s; retrying", type(exc).__name__, exc)
                await self._pause(backoff_s)
                backoff_s = min(backoff_s * 2, self._max_backoff_s)
                continue
            if count < self._batch:
                # Let a batch accumulate rather than commit one record at a time.
                await self._pause(self._interval_s)

    async def ensure_group(self) -> None:
        try:
            await self._redis.xgroup_create(self._stream, FLUSHER_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def fold_if_due(self) -> int:
        """Folds the pending rollup changes when ``FOLD_INTERVAL_S`` has passed since the last
        fold; returns how many it moved."""
        now = time.monotonic()
        if now < self._next_fold:
            return 0
        async with self._sessionmaker() as session, session.begin():
            moved = await fold_usage_rollups(session)
        # A full fold leaves more (a backlog after an outage): the next pass folds again.
        self._next_fold = now if moved >= FOLD_LIMIT else now + FOLD_INTERVAL_S
        return moved

    async def flush_once(self) -> int:
        """Processes one batch (reclaimed, else new); returns how many entries it handled."""
        entries = await self.claim_pending()
        if not entries:
            entries = await self.read_new()
        if not entries:
            USAGE_FLUSH_LAG.set(0)
            return 0
        if not await self.write(entries):
            return 0
        await self.acknowledge(entries)
        return len(entries)

    async def claim_pending(self) -> list[Entry]:
        """This consumer's own unacknowledged entries, then idle ones of other consumers."""
        response = await self._redis.xreadgroup(
            FLUSHER_GROUP, self.consumer, {self._stream: "0"}, count=self._batch
        )
        own = _stream_entries(response)
        deleted_own = [entry_id for entry_id, fields in own if not fields]
        if deleted_own:
            # Acknowledged and deleted elsewhere after this consumer had read them.
            await self._redis.xack(self._stream, FLUSHER_GROUP, *deleted_own)
        own = [entry for entry in own if entry[1]]
        if own:
            return own
        now = time.monotonic()
        if now < self._next_claim:
            return []
        self._next_claim = now + self._claim_every_s
        # Redis 7 answers (cursor, claimed, deleted ids); Redis 6.2 has no third element.
        cursor_claimed_deleted = await self._redis.xautoclaim(
            self._stream,
            FLUSHER_GROUP,
            self.consumer,
            min_idle_time=self._claim_idle_ms,
            start_id="0-0",
            count=self._batch,
        )
        claimed = cursor_claimed_deleted[1]
        deleted = cursor_claimed_deleted[2] if len(cursor_claimed_deleted) > 2 else []
        if deleted:
            await self._redis.xack(self._stream, FLUSHER_GROUP, *deleted)
        if claimed:
            logger.info(
                "usage flusher %s reclaimed %d pending entries", self.consumer, len(claimed)
            )
        return [entry for entry in claimed if entry[1]]

    async def read_new(self) -> list[Entry]:
        response = await self._redis.xreadgroup(
            FLUSHER_GROUP,
            self.consumer,
            {self._stream: ">"},
            count=self._batch,
            # Capped under the client's socket timeout, whatever the flush interval.
            block=max(1, int(min(self._interval_s, 1.0) * 1000)),
        )
        return _stream_entries(response)

    async def write(self, entries: Sequence[Entry]) -> bool:
        """Commits the entries' records, retrying while the database is down.

        Returns False only when asked to stop before the commit succeeded (the entries stay
        pending for a later attempt).
        """
        rows = _decode_rows(entries)
        oldest = min(_entry_time(entry_id) for entry_id, _ in entries)
        backoff_s = 0.05
        while True:
            try:
                self.flushed += await self._insert(rows)
                USAGE_FLUSH_LAG.set(max(0.0, time.time() - oldest))
                return True
            except Exception as exc:
                USAGE_FLUSH_LAG.set(max(0.0, time.time() - oldest))
                logger.warning(
                    "usage flusher: %d records not committed (%s: %s); retrying in %.2fs",
                    len(rows),
                    type(exc).__name__,
                    exc,
                    backoff_s,
                )
            if self._stopping.is_set():
                return False
            await self._pause(backoff_s)
            backoff_s = min(backoff_s * 2, self._max_backoff_s)

    async def _insert(self, rows: list[dict[str, Any]]) -> int:
        try:
            async with self._sessionmaker() as session, session.begin():
                return await insert_usage(session, rows)
        except (DataError, IntegrityError):
            if len(rows) == 1:
                # A record the database can never accept would block the stream forever.
                logger.exception("usage flusher: dropping unstorable record %s", rows[0])
                return 0
        inserted = 0
        for row in rows:
            inserted += await self._insert([row])
        return inserted

    async def acknowledge(self, entries: Sequence[Entry]) -> None:
        ids = [entry_id for entry_id, _ in entries]
        pipe = self._redis.pipeline(transaction=False)
        pipe.xack(self._stream, FLUSHER_GROUP, *ids)
        pipe.xdel(self._stream, *ids)
        await pipe.execute()

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)


def _stream_entries(response: Any) -> list[Entry]:
    # RESP2 answers [[stream, entries]], RESP3 {stream: [entries]}.
    if not response:
        return []
    if isinstance(response, dict):
        return [entry for entries in response.values() for entry in entries[0]]
    return [entry for _, entries in response for entry in entries]


def _decode_rows(entries: Sequence[Entry]) -> list[dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = {}
    for entry_id, fields in entries:
        payload = fields.get(EVENT_FIELD, fields.get(EVENT_FIELD.decode()))
        try:
            row = _row(_decoder.decode(payload))
        except (msgspec.ValidationError, msgspec.DecodeError, TypeError, ValueError) as exc:
            logger.error("usage flusher: dropping malformed entry %s: %s", entry_id, exc)
            continue
        seen = rows.get(row["request_id"])
        if seen is None or bills_more(row, seen):
            # A request recorded twice (a reaper's partial count, then its replica's own)
            # keeps the larger record, whichever reached the stream first.
            rows[row["request_id"]] = row
    return list(rows.values())

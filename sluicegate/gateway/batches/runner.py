"""The batch runner: every replica (``SLUICEGATE_RUN_BATCH_RUNNER``) claims lines of batches in
progress, up to ``SLUICEGATE_BATCH_CONCURRENCY`` at a time, and runs each as a live request of
the batch's key (``dispatch``), then settles it in PostgreSQL (``claims``).

- A line refused for its key's budget (429 ``insufficient_quota``) ends as an error line, as
  does any other refusal or failure; a line refused by a rate limit (requests or tokens a
  minute, concurrency) waits what the refusal says and is tried again, within the window.
- A running line's claim is renewed every third of ``SLUICEGATE_BATCH_CLAIM_S``; a replica
  that dies stops renewing, and its lines are claimed again by others once the claim lapses.
  The dead replica's admitted requests are settled by the lease reaper as any request is.
- After each settled line, and on a sweep every few seconds, batches with nothing left to run
  are ended (``finalize``).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
import uuid
from typing import Any

import msgspec
from litestar.types import ASGIApp
from sqlalchemy import select, text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluicegate.gateway.api.anthropic_errors import anthropic_error
from sluicegate.gateway.batches.claims import (
    ClaimedLine,
    LineResult,
    claim_lines,
    renew_claims,
    settle_line,
)
from sluicegate.gateway.batches.dispatch import Answer, dispatch
from sluicegate.gateway.batches.file_store import FileStore
from sluicegate.gateway.batches.finalize import finalize, ready_batches
from sluicegate.gateway.batches.wire import ANTHROPIC_ENDPOINT
from sluicegate.gateway.call.settle import usage_event
from sluicegate.gateway.db.models import ApiKey, Team
from sluicegate.gateway.errors import AuthenticationFailed, OpenAIError
from sluicegate.gateway.keys.records import ApiKeyRecord
from sluicegate.gateway.services import BatchLineContext
from sluicegate.gateway.settings import Settings
from sluicegate.gateway.usage.stream import usage_row

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.5
"""How often an idle runner looks for claimable lines."""
SWEEP_S = 2.0
"""How often it looks for batches to end (expired, cancelled, or left by a dead finalizer)."""
KEY_TTL_S = 5.0
"""How long a batch key's record is trusted before it is read again (revocations, limits)."""
_RATE_LIMIT_WAIT_S = (0.05, 5.0)
DRAIN_S = 5.0
"""How long a stopping runner lets its running lines finish before it cuts them short."""


class BatchRunner:
    def __init__(
        self,
        app: ASGIApp,
        sessionmaker: async_sessionmaker[AsyncSession],
        settings: Settings,
        files: FileStore,
    ) -> None:
        if settings.batch_concurrency < 1 or settings.batch_price_multiplier < 0:
            raise ValueError(
                "SLUICEGATE_BATCH_CONCURRENCY must be at least 1 and "
                "SLUICEGATE_BATCH_PRICE_MULTIPLIER at least 0"
            )
        self._app = app
        self._sessionmaker = sessionmaker
        self._settings = settings
        self._files = files
        self._me = f"{settings.instance_id}-{uuid.uuid4().hex[:8]}"
        self._running: set[asyncio.Task[None]] = set()
        self._keys: dict[uuid.UUID, tuple[float, ApiKeyRecord | None]] = {}
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._claim_loop(), name="batch-claims"),
            asyncio.create_task(self._renew_loop(), name="batch-renewals"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        # Lines under way finish (their answers stored, then settled) if they can in time.
        if self._running:
            await asyncio.wait(set(self._running), timeout=DRAIN_S)
        for task in list(self._running):
            task.cancel()
        await asyncio.gather(*self._tasks, *self._running, return_exceptions=True)
        # Lines cut short go back to pending at once, rather than after their claims lapse.
        with contextlib.suppress(SQLAlchemyError, OSError):
            async with self._sessionmaker() as session, session.begin():
                await session.execute(
                    text(
                        "UPDATE batch_lines SET state = 'pending', claimed_by = NULL, "
                        "claim_expires_at = NULL WHERE claimed_by = :me AND state = 'running'"
                    ),
                    {"me": self._me},
                )

    async def _claim_loop(self) -> None:
        swept = 0.0
        while True:
            try:
                free = self._settings.batch_concurrency - len(self._running)
                if free > 0:
                    for line in await self._claim(free):
                        task = asyncio.create_task(self._run(line))
                        self._running.add(task)
                        task.add_done_callback(self._line_done)
                if time.monotonic() - swept >= SWEEP_S:
                    swept = time.monotonic()
                    for batch_id in await ready_batches(self._sessionmaker):
                        await finalize(self._sessionmaker, self._files, batch_id)
            except (SQLAlchemyError, OSError, OpenAIError) as exc:
                logger.warning("batch runner: %s", exc)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), IDLE_POLL_S)

    def _line_done(self, task: asyncio.Task[None]) -> None:
        self._running.discard(task)
        self._wake.set()
        if not task.cancelled() and task.exception() is not None:
            logger.error("batch line failed", exc_info=task.exception())

    async def _claim(self, limit: int) -> list[ClaimedLine]:
        async with self._sessionmaker() as session, session.begin():
            return await claim_lines(session, self._me, limit, self._settings.batch_claim_s)

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self._settings.batch_claim_s / 3)
            if not self._running:
                continue
            try:
                async with self._sessionmaker() as session, session.begin():
                    await renew_claims(session, self._me, self._settings.batch_claim_s)
            except (SQLAlchemyError, OSError) as exc:
                logger.warning("batch runner could not renew its claims: %s", exc)

    async def _key(self, key_id: uuid.UUID) -> ApiKeyRecord | None:
        cached = self._keys.get(key_id)
        if cached is not None and time.monotonic() - cached[0] < KEY_TTL_S:
            return cached[1]
        query = (
            select(ApiKey, Team)
            .outerjoin(Team, ApiKey.team_id == Team.id)
            .where(ApiKey.id == key_id)
        )
        async with self._sessionmaker() as session:
            row = (await session.execute(query)).first()
        record = ApiKeyRecord.from_row(row[0], row[1]) if row is not None else None
        self._keys[key_id] = (time.monotonic(), record)
        return record

    async def _run(self, claimed: ClaimedLine) -> None:
        key = await self._key(claimed.key_id)
        refusal = _key_refusal(key)
        if refusal is not None or key is None:
            await self._store(claimed, _refused(claimed, refusal))
            await finalize(self._sessionmaker, self._files, claimed.batch_id)
            return
        line = BatchLineContext(key, self._settings.batch_price_multiplier)
        try:
            result = await self._serve(claimed, line)
            stored = await self._store(claimed, result)
        finally:
            if line.settlement is not None:
                # Whatever happened to the stored result, the served answer is settled.
                await asyncio.shield(line.settlement)
        if stored:
            await finalize(self._sessionmaker, self._files, claimed.batch_id)

    async def _store(self, claimed: ClaimedLine, result: LineResult) -> bool:
        for attempt in range(5):
            try:
                async with self._sessionmaker() as session, session.begin():
                    if not await settle_line(session, self._me, claimed, result):
                        logger.warning(
                            "batch %s line %d was claimed by another replica meanwhile; its "
                            "result from here is dropped",
                            claimed.batch_id,
                            claimed.line,
                        )
                        return False
                return True
            except (SQLAlchemyError, OSError) as exc:
                logger.warning("settling batch line failed (%s); retrying", exc)
                await asyncio.sleep(0.2 * 2**attempt)
        return False  # the claim lapses and another replica runs the line again

    async def _serve(self, claimed: ClaimedLine, line: BatchLineContext) -> LineResult:
        path = ANTHROPIC_ENDPOINT if claimed.api == "anthropic" else claimed.endpoint
        body = msgspec.json.encode(claimed.body)
        wait = _RATE_LIMIT_WAIT_S[0]
        while True:
            answer = await dispatch(self._app, path, body, line)
            if not _rate_limited(answer):
                break
            # Limits per minute or concurrency: the line waits its turn instead of failing.
            retry_after = answer.headers.get("retry-after")
            delay = float(retry_after) if retry_after else wait
            wait = min(wait * 2, _RATE_LIMIT_WAIT_S[1])
            await asyncio.sleep(min(max(delay, _RATE_LIMIT_WAIT_S[0]), 60.0))
        prompt = completion = cost = 0
        usage = None
        call = line.call
        if call is not None:
            event = usage_event(call)
            prompt, completion, cost = (
                event.prompt_tokens,
                event.completion_tokens,
                event.cost_micros,
            )
            if line.settlement is not None:  # served: its settle is the runner's to run
                usage = usage_row(event)
        return LineResult(
            answer.status,
            answer.body.decode("utf-8", "replace") if answer.body else "null",
            answer.headers.get("x-request-id", ""),
            prompt,
            completion,
            cost,
            usage,
        )


def _refused(claimed: ClaimedLine, refusal: OpenAIError | None) -> LineResult:
    refusal = refusal or AuthenticationFailed("The API key that created this batch is gone.")
    if claimed.api == "anthropic":
        status, body = anthropic_error(refusal)
    else:
        status, body = refusal.status_code, refusal.body()
    return LineResult(status, msgspec.json.encode(body).decode(), "")


def _key_refusal(key: ApiKeyRecord | None) -> OpenAIError | None:
    if key is None or key.revoked:
        return AuthenticationFailed("The API key that created this batch has been revoked.")
    if key.expires_at is not None and key.expires_at <= dt.datetime.now(dt.UTC):
        return AuthenticationFailed("The API key that created this batch has expired.")
    return None


def _rate_limited(answer: Answer) -> bool:
    """A 429 for a rate limit or concurrency (not a spent budget, which ends the line)."""
    if answer.status != 429:
        return False
    try:
        error: Any = msgspec.json.decode(answer.body).get("error", {})
    except (msgspec.DecodeError, AttributeError):
        return False
    # OpenAI's shape names the code; Anthropic's only the type (a spent budget included).
    return bool(error.get("code") == "rate_limit_exceeded") or (
        error.get("type") == "rate_limit_error" and "budget" not in error.get("message", "")
    )

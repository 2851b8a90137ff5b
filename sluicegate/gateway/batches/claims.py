"""The runner's claims on batch lines, in PostgreSQL: take, renew, settle.

A line is taken with ``FOR UPDATE SKIP LOCKED`` (replicas never wait on each other's picks) when
it is pending, or running under a claim that lapsed: its replica died, or lost PostgreSQL for
longer than a claim. Its result is written only by the claim's holder, identified by replica and
attempt, so a line whose claim was taken over meanwhile cannot end twice. A settle locks the
batch row first, as the finalizer does, so the two never wait on each other in turn.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from sluicegate.gateway.db.usage import insert_usage

_CLAIM = text(
    """
    WITH picked AS (
        SELECT l.batch_id, l.line FROM batch_lines l JOIN batches b ON b.id = l.batch_id
        WHERE b.status = 'in_progress' AND b.expires_at > now()
          AND (l.state = 'pending' OR (l.state = 'running' AND l.claim_expires_at < now()))
        ORDER BY b.created_at, l.batch_id, l.line
        LIMIT :limit
        FOR UPDATE OF l SKIP LOCKED
    )
    UPDATE batch_lines l
    SET state = 'running', claimed_by = :me, attempts = l.attempts + 1,
        claim_expires_at = now() + make_interval(secs => :claim_s)
    FROM picked, batches b
    WHERE l.batch_id = picked.batch_id AND l.line = picked.line AND b.id = l.batch_id
    RETURNING l.batch_id, l.line, l.custom_id, l.body, l.attempts, b.key_id, b.endpoint, b.api
    """
)
_RENEW = text(
    """
    UPDATE batch_lines SET claim_expires_at = now() + make_interval(secs => :claim_s)
    WHERE claimed_by = :me AND state = 'running'
    """
)
_LOCK_BATCH = text("SELECT 1 FROM batches WHERE id = :batch_id FOR UPDATE")
_SETTLE = text(
    """
    UPDATE batch_lines
    SET state = 'done', status_code = :status_code, response = CAST(:response AS jsonb),
        request_id = :request_id, prompt_tokens = :prompt_tokens,
        completion_tokens = :completion_tokens, claimed_by = NULL, claim_expires_at = NULL
    WHERE batch_id = :batch_id AND line = :line AND state = 'running'
      AND claimed_by = :me AND attempts = :attempts
    """
)
_TALLY = text(
    """
    UPDATE batches
    SET succeeded = succeeded + :succeeded, failed = failed + :failed,
        prompt_tokens = prompt_tokens + :prompt_tokens,
        completion_tokens = completion_tokens + :completion_tokens,
        cost_micros = cost_micros + :cost_micros
    WHERE id = :batch_id
    """
)


@dataclass(frozen=True, slots=True)
class ClaimedLine:
    batch_id: str
    line: int
    custom_id: str
    body: dict[str, Any]
    attempts: int
    key_id: uuid.UUID
    endpoint: str
    api: str


@dataclass(frozen=True, slots=True)
class LineResult:
    status_code: int
    response: str
    """The endpoint's JSON body, as text."""
    request_id: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_micros: int = 0
    usage: dict[str, Any] | None = None
    """The served answer's ``usage_records`` row, committed with the line (see settle_line)."""


async def claim_lines(
    session: AsyncSession, me: str, limit: int, claim_s: float
) -> list[ClaimedLine]:
    rows = await session.execute(_CLAIM, {"me": me, "limit": limit, "claim_s": claim_s})
    return [ClaimedLine(*row) for row in rows]


async def renew_claims(session: AsyncSession, me: str, claim_s: float) -> None:
    await session.execute(_RENEW, {"me": me, "claim_s": claim_s})


async def settle_line(
    session: AsyncSession, me: str, claimed: ClaimedLine, result: LineResult
) -> bool:
    """Write the line's result while ``me`` still holds its claim; whether it did.

    A served answer's usage row is inserted in the same transaction, so a line is stored if
    and only if its usage is: the request's settle in Redis, which follows, records the same
    row again (idempotent on request id), and a reaper that settles it instead, should this
    replica die in between, records one that bills less, which never replaces it."""
    await session.execute(_LOCK_BATCH, {"batch_id": claimed.batch_id})
    written = await session.execute(
        _SETTLE,
        {
            "batch_id": claimed.batch_id,
            "line": claimed.line,
            "me": me,
            "attempts": claimed.attempts,
            "status_code": result.status_code,
            "response": result.response,
            "request_id": result.request_id,
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
        },
    )
    if written.rowcount != 1:  # type: ignore[attr-defined]
        return False
    ok = 200 <= result.status_code < 300
    await session.execute(
        _TALLY,
        {
            "batch_id": claimed.batch_id,
            "succeeded": int(ok),
            "failed": int(not ok),
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
            "cost_micros": result.cost_micros,
        },
    )
    if result.usage is not None:
        await insert_usage(session, [result.usage])
    return True

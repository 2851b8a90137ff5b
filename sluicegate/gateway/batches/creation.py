"""What both APIs' controllers share: who asks, query options, making a batch from its lines."""

from __future__ import annotations

import datetime as dt
import os
from typing import Any

from litestar import Request
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluicegate.gateway.batches.file_store import FileStore
from sluicegate.gateway.batches.queries import Owner, insert_batch, utcnow
from sluicegate.gateway.batches.wire import LineError
from sluicegate.gateway.db.batch_tables import Batch
from sluicegate.gateway.errors import InvalidRequest
from sluicegate.gateway.keys.records import ApiKeyRecord
from sluicegate.gateway.stored.items import refuse_unsupported

WINDOW = dt.timedelta(hours=24)
MAX_METADATA_PAIRS = 16


def owner(request: Request[Any, Any, Any]) -> Owner:
    key: ApiKeyRecord = request.scope["state"]["api_key"]
    return Owner.of(key.id, key.team_id)


def sessions(request: Request[Any, Any, Any]) -> async_sessionmaker[AsyncSession]:
    return request.app.state.db_sessionmaker  # type: ignore[no-any-return]


def files(request: Request[Any, Any, Any]) -> FileStore:
    return request.app.state.batch_files  # type: ignore[no-any-return]


def query_options(request: Request[Any, Any, Any], supported: frozenset[str]) -> dict[str, str]:
    query = dict(request.query_params)
    refuse_unsupported(query, supported)
    return query


def limit_option(query: dict[str, str], default: int, maximum: int) -> int:
    raw = query.get("limit", str(default))
    limit = int(raw) if raw.isdigit() else 0
    if not 1 <= limit <= maximum:
        raise InvalidRequest(f"'limit' must be an integer from 1 to {maximum}.", param="limit")
    return limit


def check_metadata(metadata: Any) -> dict[str, str] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidRequest(
            f"'metadata' must be an object of at most {MAX_METADATA_PAIRS} pairs.",
            param="metadata",
        )
    for name, value in metadata.items():
        if len(name) > 64 or not isinstance(value, str) or len(value) > 512:
            raise InvalidRequest(
                "'metadata' keys are at most 64 characters, values strings of at most 512.",
                param="metadata",
            )
    return metadata


async def create_batch(
    sessionmaker: async_sessionmaker[AsyncSession],
    asker: Owner,
    *,
    api: str,
    endpoint: str,
    lines: list[tuple[str, dict[str, Any]]],
    errors: list[LineError] | None = None,
    input_file_id: str | None = None,
    metadata: dict[str, str] | None = None,
) -> Batch:
    """A batch in progress, or failed at once when its input had ``errors`` (OpenAI's way:
    the batch exists, its ``errors`` say why it never ran)."""
    now = utcnow()
    prefix = "msgbatch_" if api == "anthropic" else "batch_"
    failed = bool(errors)
    batch = Batch(
        id=prefix + os.urandom(12).hex(),
        api=api,
        key_id=asker.key_id,
        team_id=asker.team_id,
        endpoint=endpoint,
        input_file_id=input_file_id,
        completion_window="24h",
        status="failed" if failed else "in_progress",
        batch_metadata=metadata,
        errors=[e.as_dict() for e in errors] if errors else None,
        total=0 if failed else len(lines),
        succeeded=0,
        failed=0,
        prompt_tokens=0,
        completion_tokens=0,
        cost_micros=0,
        created_at=now,
        expires_at=now + WINDOW,
        in_progress_at=None if failed else now,
        ended_at=now if failed else None,
    )
    async with sessionmaker() as session, session.begin():
        await insert_batch(session, batch, [] if failed else lines)
    return batch

"""``ResponseStore``: stored Responses in PostgreSQL, as the Responses routes use them.

Reads answer in OpenAI's shapes: a response another team owns is a 404, as one that never
existed; a database that cannot answer is a 503. A write that fails is logged and the answer
still goes out: it was generated and billed, and the client holds it (only continuing it or
reading it back later will find nothing).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import uuid
from collections.abc import Iterator
from typing import Any

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluicegate.gateway.db.responses import (
    Owner,
    delete_response,
    insert_response,
    select_items,
    select_response,
)
from sluicegate.gateway.errors import NotFound, ServiceUnavailable
from sluicegate.gateway.keys.records import ApiKeyRecord
from sluicegate.gateway.stored.items import continued

logger = logging.getLogger(__name__)

_UNAVAILABLE = (SQLAlchemyError, OSError, TimeoutError)


def owner_of(key: ApiKeyRecord) -> Owner:
    team = key.team_id
    return Owner(uuid.UUID(key.id), uuid.UUID(team) if team is not None else None)


def _missing(response_id: str, param: str | None = None) -> NotFound:
    return NotFound(f"Response with id '{response_id}' not found.", param=param)


@contextlib.contextmanager
def _database() -> Iterator[None]:
    try:
        yield
    except _UNAVAILABLE as exc:
        logger.warning("stored responses: %s: %s", type(exc).__name__, exc)
        raise ServiceUnavailable("Stored responses are unavailable; retry shortly.") from None


class ResponseStore:
    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession]) -> None:
        self._sessionmaker = sessionmaker

    async def history(self, owner: Owner, response_id: str) -> list[dict[str, Any]]:
        """The items a response continuing ``response_id`` starts from (a 404 naming
        ``previous_response_id`` when the owner sees no such response)."""
        with _database():
            async with self._sessionmaker() as session:
                found = await select_items(session, owner, response_id)
        if found is None:
            raise _missing(response_id, "previous_response_id")
        response, items = found
        return continued(items, response)

    async def save(
        self, owner: Owner, response: dict[str, Any], input_items: list[dict[str, Any]]
    ) -> bool:
        """Keeps ``response``; False (logged) when the database would not take it."""
        try:
            async with self._sessionmaker() as session, session.begin():
                created = dt.datetime.fromtimestamp(response["created_at"], dt.UTC)
                await insert_response(session, owner, response, input_items, created)
        except _UNAVAILABLE as exc:
            logger.warning(
                "stored responses: %s not stored: %s: %s", response["id"], type(exc).__name__, exc
            )
            return False
        return True

    async def get(self, owner: Owner, response_id: str) -> dict[str, Any]:
        with _database():
            async with self._sessionmaker() as session:
                response = await select_response(session, owner, response_id)
        if response is None:
            raise _missing(response_id)
        return response

    async def input_items(self, owner: Owner, response_id: str) -> list[dict[str, Any]]:
        with _database():
            async with self._sessionmaker() as session:
                found = await select_items(session, owner, response_id)
        if found is None:
            raise _missing(response_id)
        return found[1]

    async def delete(self, owner: Owner, response_id: str) -> None:
        with _database():
            async with self._sessionmaker() as session, session.begin():
                deleted = await delete_response(session, owner, response_id)
        if not deleted:
            raise _missing(response_id)

"""Retention of stored Responses (``SLUICEGATE_RESPONSE_RETENTION_DAYS``, 30 by default as
OpenAI's): the usage pruner's batches, pauses and passes, over ``stored_responses``.

Every replica runs one (several split the work, ``SKIP LOCKED``): responses are written by
every replica, not by the usage flushers alone.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy.ext.asyncio import AsyncSession

from sluicegate.gateway.db.responses import delete_responses_before
from sluicegate.gateway.usage.retention import UsageRetention


class ResponseRetention(UsageRetention):
    label = "response retention"

    async def delete_before(self, session: AsyncSession, cutoff: dt.datetime, limit: int) -> int:
        return await delete_responses_before(session, cutoff, limit)

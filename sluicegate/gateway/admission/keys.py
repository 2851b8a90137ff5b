"""The Redis key names of admission: per key and team (one Cluster hash tag for both), per
minute window and per budget period; and the limits they are checked against."""

from __future__ import annotations

import functools
from datetime import UTC, datetime
from typing import Protocol


class ScopeLimits(Protocol):
    """The limits of a key or of its team (``sluicegate.gateway.keys.auth.ApiKeyRecord``, ``TeamLimits``)."""

    id: str
    rpm_limit: int | None
    tpm_limit: int | None
    max_parallel_requests: int | None
    token_budget: int | None
    max_budget_micros: int | None
    budget_period: str | None


class KeyLimits(ScopeLimits, Protocol):
    team: ScopeLimits | None


def budget_period_id(period: str | None, now: float) -> tuple[str, int]:
    """The current period's bucket name and a TTL that outlives it."""
    return _period_of_minute(period, int(now // 60))


@functools.lru_cache(maxsize=64)
def _period_of_minute(period: str | None, minute: int) -> tuple[str, int]:
    # Days and months start on a minute boundary, so one answer serves the whole minute.
    moment = datetime.fromtimestamp(minute * 60, UTC)
    if period == "month":
        return moment.strftime("%Y%m"), 32 * 86400
    if period == "day":
        return moment.strftime("%Y%m%d"), 2 * 86400
    return "all", 400 * 86400


def scope_tag(kind: str, scope_id: str, team_id: str | None) -> str:
    """Key names of a scope. A key of a team carries the team's hash tag, so one admission
    touches one Redis Cluster slot; a key without a team keeps ``{key-id}``."""
    if team_id is None:
        return f"sg:rl:{{{scope_id}}}"
    return f"sg:rl:{{{team_id}}}:team" if kind == "team" else f"sg:rl:{{{team_id}}}:k:{scope_id}"


def budget_keys(
    kind: str, scope: ScopeLimits, team_id: str | None, now: float
) -> tuple[str, str, int]:
    """``(token counter, money counter, ttl)`` of the current budget period of a scope."""
    tag = scope_tag(kind, scope.id, team_id)
    period, ttl = budget_period_id(scope.budget_period, now)
    return f"{tag}:b:{period}", f"{tag}:m:{period}", ttl

"""Admin API under ``/admin`` (master key only): API keys, usage reports, models."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Annotated, Any, Literal

import msgspec
from litestar import Controller, Request, delete, get, patch, post
from litestar.params import FromPath, FromQuery, JSONBody, Parameter
from msgspec import UNSET, Meta, UnsetType
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.auth import admin_guard, generate_key, publish_invalidation
from gateway.db import keys as key_queries
from gateway.db import usage as usage_queries
from gateway.db.models import ApiKey
from gateway.errors import NotFound

Name = Annotated[str, Meta(min_length=1, max_length=200)]
PositiveInt = Annotated[int, Meta(ge=1)]
TokenCount = Annotated[int, Meta(ge=0)]
AwareDatetime = Annotated[dt.datetime, Meta(tz=True)]
BudgetPeriod = Literal["day", "month"]
GroupBy = Literal["day", "model", "key"]


class KeyCreate(msgspec.Struct, forbid_unknown_fields=True):
    name: Name
    allowed_models: list[str] = msgspec.field(default_factory=list)
    """Public model names the key may use; empty means all."""
    rpm_limit: PositiveInt | None = None
    tpm_limit: PositiveInt | None = None
    max_parallel_requests: PositiveInt | None = None
    token_budget: TokenCount | None = None
    budget_period: BudgetPeriod | None = None
    """``day`` or ``month`` (UTC); without it the budget is for the key's lifetime."""
    expires_at: AwareDatetime | None = None
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)


class KeyUpdate(msgspec.Struct, forbid_unknown_fields=True):
    """Only the fields present change; ``null`` removes a limit."""

    name: Name | UnsetType = UNSET
    allowed_models: list[str] | UnsetType = UNSET
    rpm_limit: PositiveInt | UnsetType | None = UNSET
    tpm_limit: PositiveInt | UnsetType | None = UNSET
    max_parallel_requests: PositiveInt | UnsetType | None = UNSET
    token_budget: TokenCount | UnsetType | None = UNSET
    budget_period: BudgetPeriod | UnsetType | None = UNSET
    expires_at: AwareDatetime | UnsetType | None = UNSET
    metadata: dict[str, Any] | UnsetType = UNSET

    def changes(self) -> dict[str, Any]:
        present = {
            name: getattr(self, name)
            for name in self.__struct_fields__
            if getattr(self, name) is not UNSET
        }
        if "metadata" in present:
            present["key_metadata"] = present.pop("metadata")
        return present


class KeyView(msgspec.Struct):
    id: str
    name: str
    key_prefix: str
    allowed_models: list[str]
    rpm_limit: int | None
    tpm_limit: int | None
    max_parallel_requests: int | None
    token_budget: int | None
    budget_period: str | None
    expires_at: dt.datetime | None
    revoked_at: dt.datetime | None
    revoked: bool
    metadata: dict[str, Any]
    created_at: dt.datetime
    updated_at: dt.datetime

    @classmethod
    def of(cls, row: ApiKey) -> KeyView:
        return cls(**_view_fields(row))


class CreatedKey(KeyView):
    key: str
    """The plaintext key: shown this once, never stored."""


class KeyList(msgspec.Struct):
    data: list[KeyView]
    object: str = "list"


class UsageRow(msgspec.Struct, omit_defaults=True):
    requests: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    day: str | None = None
    model: str | None = None
    key_id: str | None = None


class UsageReport(msgspec.Struct):
    group_by: GroupBy | None
    data: list[UsageRow]
    """One row per group (empty when not grouped)."""
    total: UsageRow


class BudgetView(msgspec.Struct):
    token_budget: int | None
    budget_period: str | None
    period_start: dt.date | None
    """First UTC day of the current period; null for a lifetime budget."""
    used_tokens: int
    """Committed usage in the period (the flusher lags requests by about a second)."""
    remaining_tokens: int | None
    """Null when the key has no budget."""


class KeyUsageReport(UsageReport):
    key_id: str
    budget: BudgetView


class ModelList(msgspec.Struct):
    data: list[dict[str, Any]]
    object: str = "list"


def _view_fields(row: ApiKey) -> dict[str, Any]:
    return {
        "id": str(row.id),
        "name": row.name,
        "key_prefix": row.key_prefix,
        "allowed_models": list(row.allowed_models),
        "rpm_limit": row.rpm_limit,
        "tpm_limit": row.tpm_limit,
        "max_parallel_requests": row.max_parallel_requests,
        "token_budget": row.token_budget,
        "budget_period": row.budget_period,
        "expires_at": row.expires_at,
        "revoked_at": row.revoked_at,
        "revoked": row.revoked_at is not None,
        "metadata": dict(row.key_metadata),
        "created_at": row.created_at,
        "updated_at": row.updated_at,
    }


def _sessions(request: Request[Any, Any, Any]) -> async_sessionmaker[AsyncSession]:
    return request.app.state.db_sessionmaker


def _key_not_found(key_id: uuid.UUID) -> NotFound:
    return NotFound(f"No API key with id '{key_id}'.", param="key_id")


_GROUP_FIELD = {"day": "day", "model": "model", "key": "key_id"}


def _row(totals: usage_queries.UsageTotals, group_by: GroupBy | None) -> UsageRow:
    row = UsageRow(**totals.as_dict())
    if group_by is not None:
        row = msgspec.structs.replace(row, **{_GROUP_FIELD[group_by]: totals.group})
    return row


async def _report(
    session: AsyncSession,
    *,
    key_id: uuid.UUID | None,
    model: str | None,
    since: dt.date | None,
    until: dt.date | None,
    group_by: GroupBy | None,
) -> tuple[list[UsageRow], UsageRow]:
    groups = await usage_queries.usage_totals(
        session, key_id=key_id, model=model, since=since, until=until, group_by=group_by
    )
    if group_by is None:
        return [], _row(groups[0], None)
    total = usage_queries.UsageTotals(
        sum(g.requests for g in groups),
        sum(g.prompt_tokens for g in groups),
        sum(g.completion_tokens for g in groups),
    )
    return [_row(g, group_by) for g in groups], _row(total, None)


class AdminController(Controller):
    path = "/admin"
    guards = (admin_guard,)
    tags = ("admin",)

    @post("/keys", status_code=201)
    async def create_key(
        self, request: Request[Any, Any, Any], data: JSONBody[KeyCreate]
    ) -> CreatedKey:
        plaintext, key_hash, prefix = generate_key()
        async with _sessions(request)() as session, session.begin():
            row = await key_queries.create_key(
                session,
                name=data.name,
                key_hash=key_hash,
                key_prefix=prefix,
                allowed_models=data.allowed_models,
                rpm_limit=data.rpm_limit,
                tpm_limit=data.tpm_limit,
                max_parallel_requests=data.max_parallel_requests,
                token_budget=data.token_budget,
                budget_period=data.budget_period,
                expires_at=data.expires_at,
                key_metadata=data.metadata,
            )
        return CreatedKey(**_view_fields(row), key=plaintext)

    @get("/keys")
    async def list_keys(
        self,
        request: Request[Any, Any, Any],
        include_revoked: FromQuery[bool] = True,
        limit: Annotated[int, Parameter(ge=1, le=1000)] = 100,
        offset: Annotated[int, Parameter(ge=0)] = 0,
    ) -> KeyList:
        async with _sessions(request)() as session:
            rows = await key_queries.list_keys(
                session, include_revoked=include_revoked, limit=limit, offset=offset
            )
        return KeyList(data=[KeyView.of(row) for row in rows])

    @get("/keys/{key_id:uuid}")
    async def get_key(
        self, request: Request[Any, Any, Any], key_id: FromPath[uuid.UUID]
    ) -> KeyView:
        async with _sessions(request)() as session:
            row = await key_queries.get_key(session, key_id)
        if row is None:
            raise _key_not_found(key_id)
        return KeyView.of(row)

    @patch("/keys/{key_id:uuid}")
    async def update_key(
        self,
        request: Request[Any, Any, Any],
        key_id: FromPath[uuid.UUID],
        data: JSONBody[KeyUpdate],
    ) -> KeyView:
        async with _sessions(request)() as session, session.begin():
            row = await key_queries.update_key(session, key_id, data.changes())
        if row is None:
            raise _key_not_found(key_id)
        await publish_invalidation(request.app.state.redis, str(key_id))
        return KeyView.of(row)

    @delete("/keys/{key_id:uuid}", status_code=200)
    async def revoke_key(
        self, request: Request[Any, Any, Any], key_id: FromPath[uuid.UUID]
    ) -> KeyView:
        async with _sessions(request)() as session, session.begin():
            row = await key_queries.revoke_key(session, key_id)
        if row is None:
            raise _key_not_found(key_id)
        await publish_invalidation(request.app.state.redis, str(key_id))
        return KeyView.of(row)

    @get("/usage")
    async def usage(
        self,
        request: Request[Any, Any, Any],
        key_id: FromQuery[uuid.UUID | None] = None,
        model: FromQuery[str | None] = None,
        since: FromQuery[dt.date | None] = None,
        until: FromQuery[dt.date | None] = None,
        group_by: FromQuery[GroupBy | None] = None,
    ) -> UsageReport:
        """Totals over UTC days ``since..until`` (inclusive) from the daily rollups."""
        async with _sessions(request)() as session:
            data, total = await _report(
                session, key_id=key_id, model=model, since=since, until=until, group_by=group_by
            )
        return UsageReport(group_by=group_by, data=data, total=total)

    @get("/keys/{key_id:uuid}/usage")
    async def key_usage(
        self,
        request: Request[Any, Any, Any],
        key_id: FromPath[uuid.UUID],
        model: FromQuery[str | None] = None,
        since: FromQuery[dt.date | None] = None,
        until: FromQuery[dt.date | None] = None,
        group_by: FromQuery[GroupBy | None] = None,
    ) -> KeyUsageReport:
        async with _sessions(request)() as session:
            row = await key_queries.get_key(session, key_id)
            if row is None:
                raise _key_not_found(key_id)
            data, total = await _report(
                session, key_id=key_id, model=model, since=since, until=until, group_by=group_by
            )
            period_start = usage_queries.budget_period_start(
                row.budget_period, dt.datetime.now(dt.UTC)
            )
            used = await usage_queries.tokens_used_since(session, key_id, period_start)
        remaining = None if row.token_budget is None else max(0, row.token_budget - used)
        budget = BudgetView(
            token_budget=row.token_budget,
            budget_period=row.budget_period,
            period_start=period_start,
            used_tokens=used,
            remaining_tokens=remaining,
        )
        return KeyUsageReport(
            group_by=group_by, data=data, total=total, key_id=str(key_id), budget=budget
        )

    @get("/models")
    async def models(self, request: Request[Any, Any, Any]) -> ModelList:
        router = getattr(request.app.state, "router", None)
        return ModelList(data=list(router.describe()) if router is not None else [])

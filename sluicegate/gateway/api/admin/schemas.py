"""Request and response bodies of the admin API. Money is in the gateway's currency (floats
for people, ``*_micros`` integers alongside for exact sums)."""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from sluicegate.gateway.db.models import ApiKey, AuditEntry, ModelPrice, Team
from sluicegate.gateway.usage.pricing import from_micros, to_micros

# The bounds, also checked by the web UI's forms.
LIMIT_MAX = 2**31 - 1
"""Limits (per minute, in parallel): PostgreSQL INTEGER columns."""
TOKEN_COUNT_MAX = 2**63 - 1
"""Token budgets: BIGINT columns."""
AMOUNT_MAX = 1e12
"""Money (prices per million tokens, budgets): in micro-units it must fit PostgreSQL's BIGINT."""
GRACE_MAX_S = 30 * 86400
"""How long a rotated key's old secret may keep working."""

Name = Annotated[str, Meta(min_length=1, max_length=200)]
PositiveInt = Annotated[int, Meta(ge=1, le=LIMIT_MAX)]
TokenCount = Annotated[int, Meta(ge=0, le=TOKEN_COUNT_MAX)]
Amount = Annotated[float, Meta(ge=0, le=AMOUNT_MAX)]
AwareDatetime = Annotated[dt.datetime, Meta(tz=True)]
BudgetPeriod = Literal["day", "month"]
Role = Literal["member", "team_admin"]
GroupBy = Literal["day", "model", "key", "team"]
Currency = Annotated[str, Meta(pattern="^[A-Za-z]{3}$")]


def _changes(struct: msgspec.Struct, renames: dict[str, str]) -> dict[str, Any]:
    present = {
        name: getattr(struct, name)
        for name in struct.__struct_fields__
        if getattr(struct, name) is not UNSET
    }
    if "max_budget" in present:
        value = present.pop("max_budget")
        present["max_budget_micros"] = None if value is None else to_micros(value)
    return {renames.get(name, name): value for name, value in present.items()}


def _money(micros: int | None) -> float | None:
    return None if micros is None else from_micros(micros)


# ---- limits (keys and teams alike) ----------------------------------------------------------


class LimitFields(msgspec.Struct, forbid_unknown_fields=True):
    """The name, models, limits and budgets a key or team is created with."""

    name: Name
    allowed_models: list[str] = msgspec.field(default_factory=list)
    """Public model names it may use; empty means all."""
    rpm_limit: PositiveInt | None = None
    tpm_limit: PositiveInt | None = None
    max_parallel_requests: PositiveInt | None = None
    token_budget: TokenCount | None = None
    max_budget: Amount | None = None
    """Money budget per ``budget_period``, in the gateway's currency."""
    budget_period: BudgetPeriod | None = None
    """``day`` or ``month`` (UTC); without it the budgets are for the lifetime."""


class LimitChanges(msgspec.Struct, forbid_unknown_fields=True):
    """Only the fields present change; ``null`` removes a limit."""

    name: Name | UnsetType = UNSET
    allowed_models: list[str] | UnsetType = UNSET
    rpm_limit: PositiveInt | UnsetType | None = UNSET
    tpm_limit: PositiveInt | UnsetType | None = UNSET
    max_parallel_requests: PositiveInt | UnsetType | None = UNSET
    token_budget: TokenCount | UnsetType | None = UNSET
    max_budget: Amount | UnsetType | None = UNSET
    budget_period: BudgetPeriod | UnsetType | None = UNSET


def limit_fields(row: ApiKey | Team) -> dict[str, Any]:
    """A key's or team's limits as the API shows them."""
    return {
        "name": row.name,
        "allowed_models": list(row.allowed_models),
        "rpm_limit": row.rpm_limit,
        "tpm_limit": row.tpm_limit,
        "max_parallel_requests": row.max_parallel_requests,
        "token_budget": row.token_budget,
        "max_budget": _money(row.max_budget_micros),
        "budget_period": row.budget_period,
    }


# ---- keys ------------------------------------------------------------------------------------


class KeyCreate(LimitFields):
    expires_at: AwareDatetime | None = None
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)
    team_id: str | None = None
    role: Role = "member"

    def fields(self) -> dict[str, Any]:
        values = _changes(self, {"metadata": "key_metadata"})
        values.pop("team_id", None)
        return values


class KeyUpdate(LimitChanges):
    expires_at: AwareDatetime | UnsetType | None = UNSET
    metadata: dict[str, Any] | UnsetType = UNSET
    team_id: str | UnsetType | None = UNSET
    role: Role | UnsetType = UNSET

    def changes(self) -> dict[str, Any]:
        return _changes(self, {"metadata": "key_metadata"})


class RotateRequest(msgspec.Struct, forbid_unknown_fields=True):
    grace_seconds: Annotated[int, Meta(ge=0, le=GRACE_MAX_S)] = 0
    """How long the replaced secret keeps working (0: it stops at once)."""


class KeyView(msgspec.Struct):
    id: str
    name: str
    key_prefix: str
    team_id: str | None
    role: str
    allowed_models: list[str]
    rpm_limit: int | None
    tpm_limit: int | None
    max_parallel_requests: int | None
    token_budget: int | None
    max_budget: float | None
    budget_period: str | None
    expires_at: dt.datetime | None
    revoked_at: dt.datetime | None
    revoked: bool
    previous_key_expires_at: dt.datetime | None
    """While a rotated key's old secret still works: when it stops."""
    metadata: dict[str, Any]
    created_at: dt.datetime
    updated_at: dt.datetime

    @classmethod
    def of(cls, row: ApiKey) -> KeyView:
        return cls(**key_fields(row))


def key_fields(row: ApiKey) -> dict[str, Any]:
    """A key as the API shows it: never its secret or hashes."""
    return {
        "id": str(row.id),
        **limit_fields(row),
        "key_prefix": row.key_prefix,
        "team_id": str(row.team_id) if row.team_id else None,
        "role": row.role,
        "expires_at": row.expires_at,
        "revoked_at": row.revoked_at,
        "revoked": row.revoked_at is not None,
        "previous_key_expires_at": row.previous_key_expires_at,
        "metadata": dict(row.key_metadata),
        "created_at": row.created_at,
        "updated_at": row.updated_at,
    }


class CreatedKey(KeyView):
    key: str
    """The plaintext key: shown this once, never stored."""


class KeyList(msgspec.Struct):
    data: list[KeyView]
    total: int
    object: str = "list"


# ---- teams -----------------------------------------------------------------------------------


class TeamCreate(LimitFields):
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)

    def fields(self) -> dict[str, Any]:
        return _changes(self, {"metadata": "team_metadata"})


class TeamUpdate(LimitChanges):
    metadata: dict[str, Any] | UnsetType = UNSET

    def changes(self) -> dict[str, Any]:
        return _changes(self, {"metadata": "team_metadata"})


class TeamView(msgspec.Struct):
    id: str
    name: str
    allowed_models: list[str]
    rpm_limit: int | None
    tpm_limit: int | None
    max_parallel_requests: int | None
    token_budget: int | None
    max_budget: float | None
    budget_period: str | None
    metadata: dict[str, Any]
    created_at: dt.datetime
    updated_at: dt.datetime

    @classmethod
    def of(cls, row: Team) -> TeamView:
        return cls(**team_fields(row))


def team_fields(row: Team) -> dict[str, Any]:
    return {
        "id": str(row.id),
        **limit_fields(row),
        "metadata": dict(row.team_metadata),
        "created_at": row.created_at,
        "updated_at": row.updated_at,
    }


class TeamList(msgspec.Struct):
    data: list[TeamView]
    object: str = "list"


# ---- prices ----------------------------------------------------------------------------------


class PriceCreate(msgspec.Struct, forbid_unknown_fields=True):
    """Per million tokens, in ``currency`` (which must be the gateway's)."""

    model: Name
    input: Amount
    output: Amount
    cached_input: Amount | None = None
    """Defaults to ``input``."""
    currency: Currency | None = None
    effective_from: AwareDatetime | None = None
    """Defaults to now; past usage keeps the cost it was given."""


class PriceView(msgspec.Struct):
    id: int
    model: str
    input: float
    cached_input: float
    output: float
    currency: str
    effective_from: dt.datetime
    created_at: dt.datetime

    @classmethod
    def of(cls, row: ModelPrice) -> PriceView:
        return cls(**price_fields(row))


def price_fields(row: ModelPrice) -> dict[str, Any]:
    return {
        "id": row.id,
        "model": row.model,
        "input": from_micros(row.input_micros),
        "cached_input": from_micros(row.cached_input_micros),
        "output": from_micros(row.output_micros),
        "currency": row.currency,
        "effective_from": row.effective_from,
        "created_at": row.created_at,
    }


class PriceList(msgspec.Struct):
    data: list[PriceView]
    configured: dict[str, dict[str, Any]]
    """Prices from the routing YAML, in force where no newer row is."""
    object: str = "list"


# ---- usage -----------------------------------------------------------------------------------


class UsageRow(msgspec.Struct, omit_defaults=True):
    requests: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cost: float
    cost_micros: int
    errors: int = 0
    day: str | None = None
    model: str | None = None
    key_id: str | None = None
    team_id: str | None = None


class UsageReport(msgspec.Struct):
    group_by: GroupBy | None
    data: list[UsageRow]
    """One row per group (empty when not grouped)."""
    total: UsageRow
    currency: str


class BudgetView(msgspec.Struct):
    token_budget: int | None
    max_budget: float | None
    budget_period: str | None
    period_start: dt.date | None
    """First UTC day of the current period; null for a lifetime budget."""
    used_tokens: int
    spend: float
    spend_micros: int
    """Booked in the current period, as admission counts it (in-flight reservations included)."""
    remaining_tokens: int | None
    remaining: float | None
    """Null when there is no such budget."""


class KeyUsageReport(UsageReport):
    key_id: str
    budget: BudgetView


class TeamUsageReport(UsageReport):
    team_id: str
    budget: BudgetView


# ---- audit -----------------------------------------------------------------------------------


class AuditView(msgspec.Struct):
    id: int
    at: dt.datetime
    actor: str
    action: str
    target_type: str
    target_id: str
    team_id: str | None
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    request_id: str | None

    @classmethod
    def of(cls, row: AuditEntry) -> AuditView:
        return cls(
            id=row.id,
            at=row.at,
            actor=row.actor,
            action=row.action,
            target_type=row.target_type,
            target_id=row.target_id,
            team_id=str(row.team_id) if row.team_id else None,
            before=row.before,
            after=row.after,
            request_id=row.request_id,
        )


class AuditList(msgspec.Struct):
    data: list[AuditView]
    has_more: bool
    object: str = "list"


class ModelList(msgspec.Struct):
    data: list[dict[str, Any]]
    object: str = "list"

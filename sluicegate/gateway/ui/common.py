"""What every UI page shares: rendering with the session's context, form parsing, paging."""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Mapping
from typing import Any

from litestar import Request
from litestar.response import Template
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluicegate.gateway.schemas.bounds import MAX_PAGE
from sluicegate.gateway.ui.charts import compact, money
from sluicegate.gateway.ui.session import CSRF_FIELD, UiSession, session_of
from sluicegate.gateway.usage.pricing import to_micros

PAGE_SIZE = 25
NAV = (
    ("overview", "/ui", "Overview"),
    ("keys", "/ui/keys", "Keys"),
    ("teams", "/ui/teams", "Teams"),
    ("usage", "/ui/usage", "Usage"),
    ("models", "/ui/models", "Models"),
    ("adapters", "/ui/adapters", "Adapters"),
    ("audit", "/ui/audit", "Audit log"),
)


class FormError(ValueError):
    """A form field that cannot be used as given; the page is shown again with the message."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


def sessions(request: Request[Any, Any, Any]) -> async_sessionmaker[AsyncSession]:
    return request.app.state.db_sessionmaker  # type: ignore[no-any-return]


def render(
    request: Request[Any, Any, Any],
    template: str,
    *,
    active: str,
    status_code: int = 200,
    **context: Any,
) -> Template:
    session: UiSession = session_of(request)
    return Template(
        template_name=template,
        status_code=status_code,
        context={
            "session": session,
            "csrf_field": CSRF_FIELD,
            "csrf_token": session.csrf,
            "nav": NAV,
            "active": active,
            "currency": request.app.state.settings.currency,
            "compact": compact,
            "money": money,
            **context,
        },
        headers={"cache-control": "no-store"},
    )


def request_id(request: Request[Any, Any, Any]) -> str | None:
    """The id ``x-request-id`` carries, for the audit log."""
    state = request.scope.get("state") or {}
    value = state.get("request_id")
    return str(value) if value else None


def text(form: Mapping[str, Any], name: str) -> str:
    return str(form.get(name) or "").strip()


def optional_int(
    form: Mapping[str, Any], name: str, *, minimum: int = 0, maximum: int | None = None
) -> int | None:
    raw = text(form, name)
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise FormError(name, f"{name.replace('_', ' ')} must be a whole number") from None
    if value < minimum:
        raise FormError(name, f"{name.replace('_', ' ')} must be at least {minimum}")
    if maximum is not None and value > maximum:
        raise FormError(name, f"{name.replace('_', ' ')} must be at most {maximum}")
    return value


def optional_micros(
    form: Mapping[str, Any], name: str, *, maximum: float | None = None
) -> int | None:
    """An amount in micro-units; ``maximum`` is in whole units."""
    raw = text(form, name)
    if not raw:
        return None
    try:
        micros = to_micros(raw)
    except ValueError:
        raise FormError(name, f"{name.replace('_', ' ')} must be an amount like 12.50") from None
    if maximum is not None and micros > to_micros(maximum):
        raise FormError(name, f"{name.replace('_', ' ')} must be at most {maximum:,.0f}")
    return micros


def optional_choice(form: Mapping[str, Any], name: str, choices: tuple[str, ...]) -> str | None:
    raw = text(form, name)
    if not raw:
        return None
    if raw not in choices:
        raise FormError(name, f"{name.replace('_', ' ')} must be one of {', '.join(choices)}")
    return raw


def models_list(form: Mapping[str, Any], name: str = "allowed_models") -> list[str]:
    return [part.strip() for part in text(form, name).replace("\n", ",").split(",") if part.strip()]


def optional_uuid(value: str | None, name: str) -> uuid.UUID | None:
    if not value:
        return None
    try:
        return uuid.UUID(value)
    except ValueError:
        raise FormError(name, f"{name.replace('_', ' ')} is not a valid id") from None


def optional_date(value: str | None, name: str) -> dt.date | None:
    if not value:
        return None
    try:
        return dt.date.fromisoformat(value)
    except ValueError:
        raise FormError(name, f"{name} must be a date like 2026-01-31") from None


def page_number(value: str | None) -> int:
    """``?page=`` as a page number: 1 when absent or not a number; past ``MAX_PAGE`` a
    ``FormError`` (a 400: its offset would overflow the database's integers)."""
    try:
        number = max(1, int(value or 1))
    except ValueError:
        return 1
    if number > MAX_PAGE:
        raise FormError("page", f"page must be at most {MAX_PAGE:,}")
    return number


def today() -> dt.date:
    return dt.datetime.now(dt.UTC).date()

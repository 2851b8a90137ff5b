"""The limits-and-budgets form that keys and teams share: reading it (within the admin API's
bounds), filling it from a row, and showing it again (with the error) when a save is refused."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from litestar import Request
from litestar.response import Template

from sluicegate.gateway.api.admin.schemas import AMOUNT_MAX, LIMIT_MAX, TOKEN_COUNT_MAX
from sluicegate.gateway.db.models import BUDGET_PERIODS
from sluicegate.gateway.ui.common import (
    FormError,
    models_list,
    optional_choice,
    optional_int,
    optional_micros,
    render,
    text,
)


def limit_fields_from_form(form: Mapping[str, Any], noun: str) -> dict[str, Any]:
    """The name, limit and budget fields of a create or edit form (empty = no limit)."""
    name = text(form, "name")
    if not name:
        raise FormError("name", f"a {noun} needs a name")
    return {
        "name": name,
        "allowed_models": models_list(form),
        "rpm_limit": optional_int(form, "rpm_limit", minimum=1, maximum=LIMIT_MAX),
        "tpm_limit": optional_int(form, "tpm_limit", minimum=1, maximum=LIMIT_MAX),
        "max_parallel_requests": optional_int(
            form, "max_parallel_requests", minimum=1, maximum=LIMIT_MAX
        ),
        "token_budget": optional_int(form, "token_budget", maximum=TOKEN_COUNT_MAX),
        "max_budget_micros": optional_micros(form, "max_budget", maximum=AMOUNT_MAX),
        "budget_period": optional_choice(form, "budget_period", BUDGET_PERIODS),
    }


def limit_values(row: Any) -> dict[str, Any]:
    """A key's or team's limit fields as the forms show them."""
    micros = row.max_budget_micros
    return {
        "name": row.name,
        "rpm_limit": row.rpm_limit,
        "tpm_limit": row.tpm_limit,
        "max_parallel_requests": row.max_parallel_requests,
        "token_budget": row.token_budget,
        "max_budget": None if micros is None else f"{micros / 1e6:.6f}".rstrip("0").rstrip("."),
        "budget_period": row.budget_period,
        "allowed_models": ", ".join(row.allowed_models),
    }


def render_edit(
    request: Request[Any, Any, Any],
    template: str,
    row: Any,
    *,
    active: str,
    notice: str | None,
    error: FormError | None,
    form: Mapping[str, Any] | None,
    **context: Any,
) -> Template:
    """An edit page: the row's saved values, or after a refused save (400) the form as sent."""
    return render(
        request,
        template,
        active=active,
        status_code=400 if error else 200,
        flash=notice,
        error=error.message if error else None,
        error_field=error.field if error else None,
        values=dict(form) if form else limit_values(row),
        **context,
    )


def render_refused_create(
    request: Request[Any, Any, Any],
    template: str,
    error: FormError,
    form: Mapping[str, Any],
    *,
    active: str,
    **context: Any,
) -> Template:
    """A list page whose create form was refused (400): the form as sent, with the error."""
    return render(
        request,
        template,
        active=active,
        status_code=400,
        error=error.message,
        error_field=error.field,
        form=dict(form),
        **context,
    )

"""The admin web UI at ``/ui``: server-rendered pages (Jinja templates, a little plain JS, one
stylesheet), shipped inside the package and served by the gateway itself — nothing is fetched
from a network, and there is no build step.

``ui_router()`` is mounted by ``create_app``; ``template_config()`` is the app's template
engine, since Litestar configures templates per application.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from litestar import Request, Router
from litestar.contrib.jinja import JinjaTemplateEngine
from litestar.response import Redirect, Template
from litestar.static_files import create_static_files_router
from litestar.template.config import TemplateConfig

from sluicegate.gateway.errors import OpenAIError
from sluicegate.gateway.ui.adapters import AdaptersPages
from sluicegate.gateway.ui.audit import AuditPages
from sluicegate.gateway.ui.auth import SignInController
from sluicegate.gateway.ui.common import FormError
from sluicegate.gateway.ui.keys import KeysPages
from sluicegate.gateway.ui.models import ModelsPages
from sluicegate.gateway.ui.session import CsrfRejected, NotSignedIn
from sluicegate.gateway.ui.teams import TeamsPages
from sluicegate.gateway.ui.usage import UsagePages

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
"""What the UI's pages need and no more: its own script and stylesheet (no inline code or
``style`` attributes anywhere in the templates), forms posting back to it, no framing."""
SECURITY_HEADERS = (
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
)


def is_ui_path(path: str) -> bool:
    return path == "/ui" or path.startswith("/ui/")


HERE = Path(__file__).resolve().parent
TEMPLATES = HERE / "templates"
STATIC = HERE / "static"


def template_config() -> TemplateConfig[JinjaTemplateEngine]:
    return TemplateConfig(directory=TEMPLATES, engine=JinjaTemplateEngine)


def _error_page(title: str, message: str, status_code: int) -> Template:
    return Template(
        template_name="error.html",
        status_code=status_code,
        context={"title": title, "message": message},
        headers={"cache-control": "no-store"},
    )


def _not_signed_in(_: Request[Any, Any, Any], __: NotSignedIn) -> Redirect:
    return Redirect("/ui", status_code=303)


def _csrf_rejected(_: Request[Any, Any, Any], __: CsrfRejected) -> Template:
    return _error_page(
        "Form refused",
        "This form did not carry this session's security token, so nothing was changed. "
        "Go back, reload the page and try again.",
        403,
    )


def _form_error(_: Request[Any, Any, Any], exc: FormError) -> Template:
    """A bad query or form value that no page showed in place (e.g. a CSV export's filters)."""
    return _error_page("Could not do that", f"{exc.message[:1].upper()}{exc.message[1:]}.", 400)


def _api_error(_: Request[Any, Any, Any], exc: OpenAIError) -> Template:
    titles = {403: "Not allowed", 404: "Not found", 409: "Conflict"}
    return _error_page(
        titles.get(exc.status_code, "Could not do that"), exc.message, exc.status_code
    )


def ui_router() -> Router:
    return Router(
        path="/",
        route_handlers=[
            SignInController,
            KeysPages,
            TeamsPages,
            UsagePages,
            ModelsPages,
            AdaptersPages,
            AuditPages,
            create_static_files_router(
                path="/ui/static", directories=[STATIC], include_in_schema=False
            ),
        ],
        exception_handlers={
            NotSignedIn: _not_signed_in,
            CsrfRejected: _csrf_rejected,
            FormError: _form_error,
            OpenAIError: _api_error,
        },
        include_in_schema=False,
    )

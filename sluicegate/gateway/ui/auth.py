"""Sign-in (``/ui`` when signed out), sign-out. The key is typed once into a password field and
exchanged for a session cookie; it is never stored, in the browser or on the server."""

from __future__ import annotations

import secrets
from typing import Any

from litestar import Controller, Request, get, post
from litestar.datastructures import Cookie
from litestar.response import Redirect, Response, Template

from sluicegate.gateway.api.admin.guards import actor_for_token
from sluicegate.gateway.errors import OpenAIError
from sluicegate.gateway.keys.auth import client_address
from sluicegate.gateway.keys.records import hash_key
from sluicegate.gateway.settings import Settings
from sluicegate.gateway.ui.overview import overview_page
from sluicegate.gateway.ui.session import (
    CSRF_FIELD,
    SESSION_COOKIE,
    SESSION_TTL_S,
    SIGNIN_CSRF_COOKIE,
    CsrfRejected,
    NotSignedIn,
    StoredSession,
    check_csrf,
    close_session,
    load_session,
    open_session,
    ui_guard,
)


def _cookie(request: Request[Any, Any, Any], name: str, value: str, max_age: int) -> Cookie:
    # Secure unless told otherwise: behind a TLS-terminating ingress the request's own scheme
    # is http (uvicorn reads no proxy headers), and a cookie sent back over plain http would
    # carry the session in the clear.
    settings: Settings = request.app.state.settings
    return Cookie(
        key=name,
        value=value,
        path="/ui",
        httponly=True,
        samesite="strict",
        secure=not settings.ui_insecure_cookies,
        max_age=max_age,
    )


def sign_in_page(
    request: Request[Any, Any, Any],
    *,
    error: str | None = None,
    status_code: int = 200,
    headers: dict[str, str] | None = None,
) -> Template:
    token = secrets.token_urlsafe(24)
    return Template(
        template_name="signin.html",
        status_code=status_code,
        context={"csrf_field": CSRF_FIELD, "csrf_token": token, "error": error},
        cookies=[_cookie(request, SIGNIN_CSRF_COOKIE, token, 3600)],
        headers={"cache-control": "no-store", **(headers or {})},
    )


def _refusal(status_code: int) -> str:
    if status_code == 403:
        return "That key may not sign in here: use the master key or a team admin key."
    if status_code == 429:
        return "Too many failed sign-ins from this address. Wait a minute and try again."
    return "That key was not accepted. Check it and try again."


class SignInController(Controller):
    path = "/ui"
    include_in_schema = False

    @get("/")
    async def home(self, request: Request[Any, Any, Any]) -> Template:
        """The overview when signed in, else the sign-in form."""
        try:
            request.scope["state"]["ui"] = await load_session(request)  # type: ignore[typeddict-item]
        except NotSignedIn:
            return sign_in_page(request)
        return await overview_page(request)

    @post("/sign-in", status_code=303)
    async def sign_in(self, request: Request[Any, Any, Any]) -> Response[Any]:
        form = await request.form()
        expected = request.cookies.get(SIGNIN_CSRF_COOKIE)
        if not expected:
            raise CsrfRejected
        check_csrf(expected, form)
        key = str(form.get("key") or "").strip()
        if not key:
            return sign_in_page(request, error="Paste a key to sign in.", status_code=400)
        state = request.app.state
        try:
            actor = await actor_for_token(
                state.settings,
                state.key_cache,
                state.admin_auth_throttle,
                key,
                client_address(request),
            )
        except OpenAIError as exc:
            retry_after = exc.headers.get("retry-after")
            return sign_in_page(
                request,
                error=_refusal(exc.status_code),
                status_code=exc.status_code,
                headers={"retry-after": retry_after} if retry_after else None,
            )
        stored = StoredSession(
            csrf=secrets.token_urlsafe(24),
            key_hash=hash_key(key),
            key_id=str(actor.key_id) if actor.key_id else None,
            team_id=str(actor.team_id) if actor.team_id else None,
        )
        session_id = await open_session(state.redis, stored)
        response = Redirect("/ui", status_code=303)
        response.cookies = [
            _cookie(request, SESSION_COOKIE, session_id, SESSION_TTL_S),
            _cookie(request, SIGNIN_CSRF_COOKIE, "", 0),
        ]
        return response

    @post("/sign-out", status_code=303, guards=[ui_guard])
    async def sign_out(self, request: Request[Any, Any, Any]) -> Response[Any]:
        check_csrf(request.scope["state"]["ui"].csrf, await request.form())  # type: ignore[typeddict-item]
        await close_session(request.app.state.redis, request.cookies.get(SESSION_COOKIE))
        response = Redirect("/ui", status_code=303)
        response.cookies = [_cookie(request, SESSION_COOKIE, "", 0)]
        return response

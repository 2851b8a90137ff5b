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
    return Cookie(
        key=name,
        value=value,
        path="/ui",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        max_age=max_age,
    )


def sign_in_page(
    request: Request[Any, Any, Any], *, error: str | None = None, status_code: int = 200
) -> Template:
    token = secrets.token_urlsafe(24)
    return Template(
        template_name="signin.html",
        status_code=status_code,
        context={"csrf_field": CSRF_FIELD, "csrf_token": token, "error": error},
        cookies=[_cookie(request, SIGNIN_CSRF_COOKIE, token, 3600)],
        headers={"cache-control": "no-store"},
    )


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
                state.settings, state.key_cache, key, client_address(request)
            )
        except OpenAIError as exc:
            message = (
                "That key may not sign in here: use the master key or a team admin key."
                if exc.status_code == 403
                else "That key was not accepted. Check it and try again."
            )
            return sign_in_page(request, error=message, status_code=exc.status_code)
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

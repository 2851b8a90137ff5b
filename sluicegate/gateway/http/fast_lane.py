"""``FastLane``: the inference endpoints' POSTs handled without Litestar's dispatch around them.

Litestar's way from the server to a handler and back (its router, exception middleware,
request and response objects, kwargs and signature model, send wrappers) costs ~80 µs a request
on the 2-core dev VM: answering the bench's request from a one-route Litestar app under the
same uvicorn took 0.11-0.13 ms more than the upstream did, from a bare ASGI app 0.035 ms more.
Against the ~0.5 ms the whole gateway adds, that is the largest single part
(bench/gateway_overhead.py --baseline: ~9 % less added latency with this lane).

The lane wraps the Litestar app and takes a POST to a route declared with ``inference_post``
itself, running that route handler as Litestar would — its guards, its ``before_request`` hook,
the handler, its ``after_response`` hook, its exception handlers for whatever is raised before
the response starts, and the app's ``before_send`` hooks on every message — with nothing in
between. The controllers stay the one definition of each endpoint;
every other request (and every request while the app has middleware, CORS or allowed hosts,
whose handling is Litestar's) goes to Litestar untouched.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from litestar import Litestar, Request
from litestar.exceptions import HTTPException, LitestarException
from litestar.routes import HTTPRoute
from litestar.status_codes import HTTP_500_INTERNAL_SERVER_ERROR
from litestar.types import Message, Receive, Scope, Send

from sluicegate.gateway.api.inference_post import inference_post


@dataclass(frozen=True, slots=True)
class _Lane:
    handler: inference_post
    call: Callable[..., Awaitable[Any]]
    before_request: Callable[[Request[Any, Any, Any]], Awaitable[Any]] | None
    after_response: Callable[[Request[Any, Any, Any]], Awaitable[Any]] | None
    exception_handlers: dict[Any, Any]


class FastLane:
    """An ASGI app: ``app`` with its inference POSTs taken the short way."""

    def __init__(self, app: Litestar) -> None:
        self.app = app
        self._lanes = _lanes(app) if _dispatch_is_plain(app) else {}

    async def __call__(self, scope: Any, receive: Receive, send: Send) -> None:
        lane = self._lanes.get(scope["path"]) if scope["type"] == "http" else None
        if lane is None or scope["method"] != "POST" or scope.get("root_path"):
            await self.app(scope, receive, send)
            return
        app = self.app
        scope["app"] = scope["litestar_app"] = app
        scope["route_handler"] = lane.handler
        scope["path_params"] = {}
        scope.setdefault("state", {})
        started = False
        hooks = app.before_send

        async def send_hooked(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            for hook in hooks:
                await hook(message, scope)
            await send(message)

        request: Request[Any, Any, Any] = Request(scope, receive, send_hooked)
        try:
            await lane.handler.authorize_connection(request)
            data = await lane.before_request(request) if lane.before_request else None
            if not data:
                data = await lane.call(request=request)
            response = await lane.handler.to_response(app=app, data=data, request=request)
            await response(scope, receive, send_hooked)
            if lane.after_response is not None:
                await lane.after_response(request)
        except Exception as exc:
            if started:
                raise LitestarException("Exception caught after response started") from exc
            await _answer_error(lane, request, exc, scope, receive, send_hooked)


async def _answer_error(
    lane: _Lane, request: Request[Any, Any, Any], exc: Exception, scope: Scope, receive: Receive,
    send: Send,
) -> None:  # fmt: skip
    """As Litestar's exception middleware answers: the route's handler for the exception."""
    handle = _exception_handler(lane.exception_handlers, exc)
    if handle is None:
        raise exc
    response = handle(request, exc)
    encoders = lane.handler.resolve_type_encoders()
    await response.to_asgi_response(app=None, request=request, type_encoders=encoders)(
        scope, receive, send
    )


def _exception_handler(handlers: dict[Any, Any], exc: Exception) -> Any:
    """Litestar's choice: an HTTP exception's status code first, then the exception's classes
    in MRO order, then (for anything not an HTTP exception) a handler for 500."""
    if isinstance(exc, HTTPException):
        by_status = handlers.get(exc.status_code)
        if by_status is not None:
            return by_status
        fallback = None
    else:
        fallback = handlers.get(HTTP_500_INTERNAL_SERVER_ERROR)
    return next((handlers[kind] for kind in type(exc).__mro__ if kind in handlers), fallback)


def _dispatch_is_plain(app: Litestar) -> bool:
    """Whether Litestar would put nothing but its router between the server and a handler."""
    return (
        not app.middleware
        and app.cors_config is None
        and not app.allowed_hosts
        and not app.after_exception
        and not app.after_request
    )


def _lanes(app: Litestar) -> dict[str, _Lane]:
    """The POST routes of ``inference_post`` handlers whose only parameter is the request."""
    lanes = {}
    for route in app.routes:
        if not isinstance(route, HTTPRoute) or route.path_parameters:
            continue
        entry = route.route_handler_map.get("POST")
        if entry is None or not isinstance(entry[0], inference_post):
            continue
        handler = entry[0]
        if list(handler.parsed_fn_signature.parameters) != ["request"]:
            continue
        if handler.resolve_dependencies() or handler.resolve_middleware() or handler.cache:
            continue
        lanes[route.path] = _Lane(
            handler,
            handler.fn,
            handler.resolve_before_request(),
            handler.resolve_after_response(),
            dict(handler.resolve_exception_handlers()),
        )
    return lanes

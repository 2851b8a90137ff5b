"""``inference_post``: its guards get the registered route handler itself, not a copy."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Litestar, Request
from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler
from litestar.testing import TestClient

from sluicegate.gateway.api.inference_post import inference_post

seen: list[BaseRouteHandler] = []


async def remember_handler(
    _: ASGIConnection[Any, Any, Any, Any], handler: BaseRouteHandler
) -> None:
    seen.append(handler)


class Echo(Controller):
    path = "/echo"
    guards = (remember_handler,)

    @inference_post("/", status_code=200)
    async def echo(self, request: Request[Any, Any, Any]) -> bytes:
        return await request.body()


def test_guards_get_the_registered_handler_not_a_copy() -> None:
    app = Litestar(route_handlers=[Echo])
    (registered,) = (
        handler
        for route in app.routes
        if route.path == "/echo"
        for handler in getattr(route, "route_handlers", ())
        if isinstance(handler, inference_post)
    )
    seen.clear()
    with TestClient(app) as client:
        for _ in range(2):
            assert client.post("/echo", content=b"hi").content == b"hi"
    assert len(seen) == 2
    assert all(handler is registered for handler in seen)

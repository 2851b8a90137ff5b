"""``FastLane`` answers the ``inference_post`` routes as Litestar would, and leaves the rest to it.

Each test serves one small app twice with uvicorn, as Litestar alone and behind the lane, and
sends both the same requests: guards, the ``before_request`` hook, the handler, ``after_response``,
exception handlers (the controller's before the app's) and ``before_send`` hooks must give the
same answers. The gateway's own API tests run behind the lane as served (create_asgi_app).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from litestar import Controller, Litestar, Request, Response, get
from litestar.config.cors import CORSConfig
from litestar.connection import ASGIConnection
from litestar.exceptions import NotAuthorizedException
from litestar.handlers import BaseRouteHandler
from litestar.types import Message, Scope

from sluicegate.gateway.api.inference_post import inference_post
from sluicegate.gateway.http.fast_lane import FastLane
from tests.gateway.api.servers import ServerThread

calls: list[str] = []


class Refused(Exception):
    pass


async def need_key(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    calls.append("guard")
    if connection.headers.get("x-key") != "ok":
        raise NotAuthorizedException("no key")


async def before(request: Request[Any, Any, Any]) -> None:
    calls.append(f"before {request.scope['path']}")


async def after(request: Request[Any, Any, Any]) -> None:
    calls.append("after")


async def stamp(message: Message, scope: Scope) -> None:
    if message["type"] == "http.response.start":
        message["headers"] = [*message.get("headers", ()), (b"x-stamped", b"1")]


def refused_here(_: Request[Any, Any, Any], exc: Refused) -> Response[Any]:
    return Response({"refused": str(exc)}, status_code=409)


def anything(_: Request[Any, Any, Any], exc: Exception) -> Response[Any]:
    return Response({"app_handler": type(exc).__name__}, status_code=500)


class Things(Controller):
    path = "/things"
    guards = (need_key,)
    exception_handlers = {Refused: refused_here}  # noqa: RUF012

    @inference_post("/", status_code=200, after_response=after)
    async def create(self, request: Request[Any, Any, Any]) -> Response[Any]:
        body = await request.json()
        if body.get("refuse"):
            raise Refused(body["refuse"])
        if body.get("crash"):
            raise RuntimeError("crash")
        calls.append("handler")
        return Response(
            {"echo": body, "route": request.route_handler.handler_name}, status_code=201
        )

    @get("/", sync_to_thread=False)
    def listing(self) -> dict[str, str]:
        calls.append("listing")
        return {"listed": "yes"}


def make_app(**options: Any) -> Litestar:
    return Litestar(
        route_handlers=[Things],
        before_request=before,
        before_send=[stamp],
        exception_handlers={Exception: anything},
        **options,
    )


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, str, FastLane]]:
    """(Litestar alone, the same app behind the lane, the lane)."""
    lane = FastLane(make_app())
    plain, fast = ServerThread(make_app()).start(), ServerThread(lane).start()
    yield plain.url, fast.url, lane
    plain.stop()
    fast.stop()


def exchange(base: str, method: str, path: str, **kwargs: Any) -> tuple[Any, ...]:
    calls.clear()
    response = httpx.request(method, base + path, timeout=10, **kwargs)
    body = response.json() if response.content else None
    return response.status_code, body, response.headers.get("x-stamped"), list(calls)


@pytest.mark.parametrize(
    ("method", "path", "kwargs"),
    [
        ("POST", "/things", {"json": {"a": 1}, "headers": {"x-key": "ok"}}),
        ("POST", "/things", {"json": {"a": 1}}),
        ("POST", "/things", {"json": {"refuse": "taken"}, "headers": {"x-key": "ok"}}),
        ("POST", "/things", {"json": {"crash": 1}, "headers": {"x-key": "ok"}}),
        ("POST", "/things", {"content": b"{not json", "headers": {"x-key": "ok"}}),
        ("POST", "/things/", {"json": {"a": 1}, "headers": {"x-key": "ok"}}),
        ("GET", "/things", {}),
        ("PUT", "/things", {"json": {}}),
        ("POST", "/nowhere", {"json": {}}),
    ],
    ids=[
        "ok",
        "guard",
        "controller-handler",
        "app-handler",
        "bad-json",
        "slash",
        "get",
        "405",
        "404",
    ],
)
def test_the_lane_answers_as_litestar_does(
    served: tuple[str, str, FastLane], method: str, path: str, kwargs: dict[str, Any]
) -> None:
    plain, fast, _ = served
    assert exchange(fast, method, path, **kwargs) == exchange(plain, method, path, **kwargs)


def test_the_lane_takes_only_inference_posts(served: tuple[str, str, FastLane]) -> None:
    _, fast, lane = served
    assert list(lane._lanes) == ["/things"]
    status, body, stamped, seen = exchange(
        fast, "POST", "/things", json={"a": 1}, headers={"x-key": "ok"}
    )
    assert (status, stamped) == (201, "1")
    assert body == {"echo": {"a": 1}, "route": "create"}
    assert seen == ["guard", "before /things", "handler", "after"]


def test_no_lane_while_the_app_has_cors_or_middleware() -> None:
    assert (
        FastLane(make_app(cors_config=CORSConfig(allow_origins=["https://ui.example"])))._lanes
        == {}
    )
    assert FastLane(make_app(allowed_hosts=["gateway.example"]))._lanes == {}
    assert list(FastLane(make_app())._lanes) == ["/things"]

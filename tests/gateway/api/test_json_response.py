"""``JSONBytes`` sends what Litestar's own ``Response`` would, and gives way to it for cookies."""

from __future__ import annotations

from typing import Any

from litestar import Litestar, Response, get
from litestar.datastructures import Cookie
from litestar.testing import TestClient

from sluicegate.gateway.http.json_response import JSON, JSONBytes

BODY = b'{"id":"chatcmpl-1","choices":[]}'
HEADERS = {"x-ratelimit-remaining-requests": "9", "x-sluicegate-deployment": "a"}


@get("/ours", sync_to_thread=False)
def ours() -> Response[Any]:
    return JSONBytes(BODY, headers=HEADERS)


@get("/litestar", sync_to_thread=False)
def litestars() -> Response[Any]:
    return Response(BODY, media_type=JSON, headers=HEADERS)


@get("/with-cookie", sync_to_thread=False)
def with_cookie() -> Response[Any]:
    answer = JSONBytes(BODY, headers=HEADERS, status_code=201)
    answer.set_cookie(Cookie(key="session", value="s"))
    return answer


def test_the_same_status_headers_and_body_as_litestars_response() -> None:
    with TestClient(Litestar([ours, litestars, with_cookie])) as client:
        fast, full = client.get("/ours"), client.get("/litestar")
        assert (fast.status_code, fast.content) == (full.status_code, full.content) == (200, BODY)
        assert dict(fast.headers) == dict(full.headers)
        assert fast.headers["content-length"] == str(len(BODY))
        assert fast.headers["content-type"] == JSON
        cookie = client.get("/with-cookie")
        assert (cookie.status_code, cookie.content) == (201, BODY)
        assert cookie.headers["x-sluicegate-deployment"] == "a"
        assert cookie.cookies["session"] == "s"

"""``JSONBytes``: the response of a whole answer whose body is already encoded JSON.

Litestar's ``Response`` becomes an ``ASGIResponse``, which checks the body again, sets the
content type and length through a header structure that decodes and searches every header per
lookup, then encodes them all once more: about 30 µs of each answer on the 2-core dev machine,
a tenth of what the gateway adds to an instant upstream. The gateway has all of it right
already, so this response sends its status, headers and body as they are.
"""

from __future__ import annotations

from typing import Any

from litestar import Request, Response
from litestar.types import ASGIApp, Receive, Scope, Send

JSON = "application/json"
_CONTENT_TYPE = (b"content-type", JSON.encode())


class JSONBytes(Response[bytes]):
    def __init__(self, content: bytes, *, headers: dict[str, str], status_code: int = 200) -> None:
        super().__init__(content, status_code=status_code, media_type=JSON, headers=headers)

    def to_asgi_response(  # type: ignore[override]
        self,
        app: Any,
        request: Request[Any, Any, Any],
        *,
        headers: dict[str, str] | None = None,
        **options: Any,
    ) -> ASGIApp:
        if self.cookies or self.background or any(options.get(name) for name in _GENERAL):
            # Whatever Litestar would add or change: its own way, in full.
            return super().to_asgi_response(app, request, headers=headers, **options)
        merged = {**headers, **self.headers} if headers else self.headers
        return _Send(self.status_code, self.content, merged)


_GENERAL = ("background", "cookies", "encoded_headers", "is_head_response")
"""``to_asgi_response`` options this response does not handle itself."""


class _Send:
    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        self.status = status
        self.body = body
        self.headers = headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        encoded = [_CONTENT_TYPE, (b"content-length", b"%d" % len(self.body))]
        encoded += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in self.headers.items()]
        await send({"type": "http.response.start", "status": self.status, "headers": encoded})
        await send({"type": "http.response.body", "body": self.body, "more_body": False})

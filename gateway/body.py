"""Request bodies read once, before any handler decodes them: size and JSON nesting bounds.

A ``before_request`` hook (it runs after the guards, before Litestar decodes ``data``) reads
the body, which Litestar caches for the decoder, and refuses with the API's error shape:
413 past ``max_body_bytes`` however the body was framed (``Content-Length`` or chunked), and
400 when JSON nests deeper than ``max_json_depth``, which would otherwise exhaust the
decoder's recursion and come back as a 500.
"""

from __future__ import annotations

import re
from typing import Any

from litestar import Request

from gateway.errors import InvalidRequest, PayloadTooLarge
from gateway.settings import Settings

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = bytes(b for b in range(256) if b not in b"[]{}")
_OPENERS = frozenset(b"[{")
_LEAF_PASSES = 4


def json_depth_exceeds(body: bytes, limit: int) -> bool:
    """Whether the JSON text nests arrays/objects deeper than ``limit``.

    Cheap for ordinary bodies (fewer brackets than the limit cannot exceed it); otherwise the
    strings are cut out and only the brackets walked, stopping as soon as the limit is passed.
    """
    if body.count(b"[") + body.count(b"{") <= limit:
        return False
    brackets = _STRING.sub(b"", body).translate(None, _NOT_BRACKET)
    # Each pass drops every innermost pair, exactly one level off the deepest branch: wide,
    # shallow bodies shrink to little before the walk below.
    passes = min(_LEAF_PASSES, limit)
    for _ in range(passes):
        marked = brackets.replace(b"[]", b"\0\0").replace(b"{}", b"\0\0")
        brackets = marked.translate(None, b"\0")
    limit -= passes
    depth = 0
    for byte in brackets:
        if byte in _OPENERS:
            depth += 1
            if depth > limit:
                return True
        else:
            depth -= 1
    return False


async def check_body(request: Request[Any, Any, Any]) -> None:
    """``before_request`` hook: enforce the size and nesting limits on a body that has one."""
    if request.method not in _BODY_METHODS:
        return
    settings: Settings = request.app.state.settings
    body = await request.body()
    if len(body) > settings.max_body_bytes:
        raise PayloadTooLarge(f"The request body exceeds the {settings.max_body_bytes}-byte limit.")
    if settings.max_json_depth and json_depth_exceeds(body, settings.max_json_depth):
        raise InvalidRequest(
            f"The JSON body nests deeper than {settings.max_json_depth} levels.",
            code="json_too_deep",
        )

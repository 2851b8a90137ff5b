"""Request bodies read once, before any handler decodes them: size and JSON nesting bounds.

A ``before_request`` hook (it runs after the guards, before Litestar decodes ``data``) reads
the body, which Litestar caches for the decoder, and refuses with the API's error shape:
413 past ``max_body_bytes`` however the body was framed (``Content-Length`` or chunked), and
400 naming the top-level field when JSON nests deeper than ``max_json_depth``, which would
otherwise exhaust the decoder's recursion and come back as a 500. Admin input (stored in PostgreSQL, which refuses
NUL in text) with a NUL character in a query parameter or a JSON string is a 400 naming it.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import msgspec
from litestar import Request
from litestar.exceptions import InternalServerException
from litestar.types import Empty
from litestar.utils.scope.state import ScopeState

from sluicegate.gateway.errors import InvalidRequest, PayloadTooLarge
from sluicegate.gateway.settings import Settings

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_STORED_PREFIX = "/admin/"
_FILE_UPLOAD = "/v1/files"
"""Multipart uploads of batch input files: their own size limit, and not JSON."""
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


_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}:]')


def deep_field(body: bytes, limit: int) -> str | None:
    """The top-level field of a JSON object body whose value nests deeper than ``limit``, for
    the error to name (None when the body is not an object or the field cannot be told)."""
    depth, key, last_string = 0, None, b'""'
    for match in _TOKEN.finditer(body):
        token = match.group()
        if token[:1] == b'"':
            last_string = token  # a key when a ':' follows it
        elif token == b":":
            if depth == 1:
                try:
                    key = msgspec.json.decode(last_string, type=str)
                except msgspec.DecodeError:
                    key = None
        elif token in (b"[", b"{"):
            depth += 1
            if depth > limit:
                return key
        else:
            depth -= 1
    return None


def _nul_field(value: Any, path: str = "") -> str | None:
    """The dotted path of the first string (or key) in decoded JSON holding a NUL."""
    if isinstance(value, str):
        return path if "\x00" in value else None
    items: Any = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for key, item in items:
        where = f"{path}.{key}" if path else str(key)
        if isinstance(key, str) and "\x00" in key:
            return where
        found = _nul_field(item, where)
        if found is not None:
            return found
    return None


def _refuse_nul(request: Request[Any, Any, Any], body: bytes) -> None:
    """Admin input is stored in PostgreSQL, whose text cannot hold NUL: a 400 naming the
    field, not the database's error as a 500."""
    param = next((k for k, v in request.query_params.multi_items() if "\x00" in k + v), None)
    if param is None and b"\\u0000" in body:
        with contextlib.suppress(msgspec.DecodeError):
            param = _nul_field(msgspec.json.decode(body))
    if param is not None:
        raise InvalidRequest(
            f"'{param}' contains a NUL character, which is not allowed.", param=param
        )


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"The request body exceeds the {limit}-byte limit.")


async def read_body(request: Request[Any, Any, Any], limit: int) -> bytes:
    """The whole body, read from the ASGI channel and kept where ``request.body()`` finds it.

    Litestar's own reading builds a header map for the length and runs an async generator:
    ~7 µs of every request, on a path where the gateway adds ~500 µs in all."""
    state = ScopeState.from_scope(request.scope)
    if state.body is not Empty:
        return state.body  # type: ignore[no-any-return]
    for name, value in request.scope["headers"]:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    receive = request.receive
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise InternalServerException("client disconnected prematurely")
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
        if not message.get("more_body", False):
            break
    body = state.body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    return body


async def check_body(request: Request[Any, Any, Any]) -> None:
    """``before_request`` hook: enforce the size and nesting limits on a body that has one,
    and keep NUL characters out of what the admin API stores."""
    # The scope's own values: request.url would parse a URL object on every request.
    scope = request.scope
    stored = scope["path"].startswith(_STORED_PREFIX)
    if scope["method"] not in _BODY_METHODS:
        if stored:
            _refuse_nul(request, b"")
        return
    settings: Settings = request.app.state.settings
    if scope["path"].rstrip("/") == _FILE_UPLOAD:
        await read_body(request, settings.max_file_bytes)
        return
    body = await read_body(request, settings.max_body_bytes)
    if settings.max_json_depth and json_depth_exceeds(body, settings.max_json_depth):
        field = deep_field(body, settings.max_json_depth)
        where = f"'{field}'" if field is not None else "The JSON body"
        raise InvalidRequest(
            f"{where} nests deeper than {settings.max_json_depth} levels.",
            code="json_too_deep",
            param=field,
        )
    if stored:
        _refuse_nul(request, body)

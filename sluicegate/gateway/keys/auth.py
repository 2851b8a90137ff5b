"""How a request presents its API key, and the key record it is answered with.

``provide_api_key`` reads the key a request presents (``Authorization:
Bearer`` or ``x-api-key``) and answers it from the replica's ``KeyCache`` (``sluicegate.gateway.keys.cache``).
A token not shaped like a key is refused without a query.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from litestar.connection import ASGIConnection

from sluicegate.gateway.errors import AuthenticationFailed
from sluicegate.gateway.keys.cache import KeyCache
from sluicegate.gateway.keys.records import ApiKeyRecord
from sluicegate.gateway.settings import Settings


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


async def provide_api_key(request: ASGIConnection[Any, Any, Any, Any]) -> ApiKeyRecord:
    """The caller's key record from ``Authorization: Bearer sk-...`` (a guard or dependency).

    Reads the KeyCache from ``app.state.key_cache``.
    """
    token = _presented_key(request.scope["headers"])
    if not token:
        raise AuthenticationFailed(
            "You didn't provide an API key. Send it as 'Authorization: Bearer sk-...' "
            "(or 'x-api-key: sk-...')."
        )
    cache: KeyCache = request.app.state.key_cache
    record = cache.cached(token)
    if record is not None:
        return record
    return await cache.lookup(token, client_address(request))


def _presented_key(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The bearer token, else ``x-api-key`` (Anthropic's clients send the key so), read from
    the ASGI headers as they are (lower-case names): no header map built per request."""
    authorization = api_key = None
    for name, value in headers:
        if name == b"authorization" and authorization is None:
            authorization = value
        elif name == b"x-api-key" and api_key is None:
            api_key = value
    if authorization is not None:
        token = bearer_token(authorization.decode("latin-1"))
        if token:
            return token
    return api_key.decode("latin-1") if api_key else None


def client_address(request: ASGIConnection[Any, Any, Any, Any]) -> str:
    """The caller's address, as throttles key on it.

    With ``trusted_proxy_count`` = 0, the TCP peer. With N, the N-th entry from the right of
    ``client_address_header`` (every line of it, as proxies may add one line each): each
    trusted proxy appends its peer, so that entry is what the outermost one saw. Entries left
    of it came from the client and could be anything; a header with fewer entries did not pass
    all the proxies, so the peer is used then.
    """
    peer = request.client.host if request.client else ""
    settings: Settings = request.app.state.settings
    count = settings.trusted_proxy_count
    if count <= 0:
        return peer
    wanted = settings.client_address_header.lower().encode("latin-1")
    entries: list[str] = []
    for name, value in request.scope["headers"]:
        if name == wanted:
            entries += value.decode("latin-1").split(",")
    if len(entries) < count:
        return peer
    return entries[-count].strip() or peer

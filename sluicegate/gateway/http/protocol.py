"""uvicorn's httptools protocol, sending a response's head together with its first body bytes.

uvicorn writes the status line and headers of a response in one ``transport.write`` and each
body chunk in another; with TCP_NODELAY each is a send of its own, and a wake-up of the client
for half a response. On the 2-core dev machine such a send costs ~17 µs of the gateway's CPU
(measured around the upstream's write), on a request path that, once admission overlaps the
upstream call (``sluicegate.gateway.admission.speculation``), is bound by the gateway's CPU. ``HeadWithBody`` holds
the head a response writes first and sends it with the next write of the connection (the body,
or a stream's first event) — in that same call, never later. A response that ends without body
bytes (HEAD) flushes it when it completes, and closing flushes first. A ``100 Continue`` is
never held: the client waits for it before it sends the body.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_INTERIM = b"HTTP/1.1 100 "


class HeadWithBody:
    """A connection's transport, as the protocol and each request's cycle write to it."""

    __slots__ = ("_held", "_transport", "expect_head")

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._held: bytes | None = None
        self.expect_head = False
        """Set when a request's headers are read: its response's first write is its head."""

    def write(self, data: bytes) -> None:
        held = self._held
        if held is not None:
            self._held = None
            self._transport.write(held + data)
        elif self.expect_head and not data.startswith(_INTERIM):
            self.expect_head = False
            self._held = data
        else:
            self._transport.write(data)

    def flush(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            self._transport.write(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` writing through ``HeadWithBody``."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.transport = HeadWithBody(transport)  # type: ignore[assignment]

    def on_headers_complete(self) -> None:
        self.transport.expect_head = True  # type: ignore[attr-defined]
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        self.transport.flush()  # type: ignore[attr-defined]
        super().on_response_complete()

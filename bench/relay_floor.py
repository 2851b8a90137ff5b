"""The least any one-process asyncio relay of HTTP/1.1 streams can do: bytes in, bytes out.

Each client connection's first bytes (a whole request, as ``bench/streams.py`` sends it) open a
connection to the upstream and go there unchanged; everything the upstream sends goes back to
the client as it arrives, one ``write`` per read, and the upstream's close ends the client's
connection. No parsing, no authentication, no accounting: what it costs per relayed chunk is
the event loop and the socket calls, the floor under the gateway's own figure.

    python bench/relay_floor.py LISTEN_PORT UPSTREAM_PORT
"""

from __future__ import annotations

import asyncio
import contextlib
import sys

from instant_upstream import use_uvloop


class _Back(asyncio.Protocol):
    """The upstream side: what it sends goes to the client."""

    def __init__(self, client: asyncio.Transport) -> None:
        self._client = client

    def data_received(self, data: bytes) -> None:
        self._client.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._client.close()


class _Front(asyncio.Protocol):
    """The client side: its request opens the upstream connection."""

    def __init__(self, upstream_port: int) -> None:
        self._upstream_port = upstream_port
        self._transport: asyncio.Transport | None = None
        self._upstream: asyncio.Transport | None = None
        self._opening: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self._upstream is not None:
            self._upstream.write(data)
        elif self._opening is None:
            self._opening = asyncio.ensure_future(self._open(data))

    async def _open(self, request: bytes) -> None:
        client = self._transport
        assert client is not None
        loop = asyncio.get_running_loop()
        try:
            upstream, _ = await loop.create_connection(
                lambda: _Back(client), "127.0.0.1", self._upstream_port
            )
        except OSError:
            client.close()
            return
        self._upstream = upstream  # type: ignore[assignment]
        upstream.write(request)  # type: ignore[attr-defined]

    def connection_lost(self, exc: Exception | None) -> None:
        if self._upstream is not None:
            self._upstream.close()


async def serve(port: int, upstream_port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: _Front(upstream_port), "127.0.0.1", port, backlog=16384
    )
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    use_uvloop()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(int(sys.argv[1]), int(sys.argv[2])))

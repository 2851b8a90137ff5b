"""A minimal keep-alive HTTP/1.1 client for the non-streaming upstream hot path.

Measured on the 2-core dev machine, one ``httpx.AsyncClient.post`` to a local upstream costs
~0.45 ms of CPU (~1 ms wall) — three times the gateway's whole latency budget — while a plain
asyncio stream exchange costs ~0.01 ms. So plain-``http://`` upstreams answer non-streaming
requests through this client; streaming and ``https://`` upstreams keep using httpx, where the
per-call cost is small next to generation or network time.

Scope, on purpose: one origin per pool, ``POST`` with a body, responses framed by
``content-length``, ``chunked`` or connection close, after any informational (1xx) heads,
which are skipped. A request on a reused connection that fails before any response byte (the
server closed an idle keep-alive connection) is sent once more on a fresh connection.
"""

from __future__ import annotations

import asyncio
import socket

MAX_HEAD_BYTES = 64 * 1024


class UpstreamConnectionError(ConnectionError):
    """Could not connect, or the connection broke before a full response arrived."""


class _Connection:
    __slots__ = ("expired", "reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.expired = False

    def close(self) -> None:
        self.writer.close()

    def expire(self) -> None:
        """The exchange ran out of time: drop the connection, which ends its pending read.
        (A timer and an abort cost a quarter of what ``asyncio.timeout`` costs per call.)"""
        self.expired = True
        self.writer.transport.abort()


class Http1Pool:
    def __init__(
        self,
        host: str,
        port: int,
        *,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 60.0,
        max_idle: int = 256,
    ) -> None:
        self.host = host
        self.port = port
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._max_idle = max_idle
        self._idle: list[_Connection] = []
        self._host_header = f"{host}:{port}"

    async def _connect(self) -> _Connection:
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                reader, writer = await asyncio.open_connection(
                    self.host, self.port, limit=MAX_HEAD_BYTES
                )
        except (OSError, TimeoutError) as exc:
            raise UpstreamConnectionError(
                f"cannot connect to {self._host_header}: {exc!r}"
            ) from exc
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return _Connection(reader, writer)

    async def post(self, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, bytes]:
        """Returns ``(status, body)``; raises UpstreamConnectionError or TimeoutError."""
        head = [f"POST {path} HTTP/1.1\r\nhost: {self._host_header}\r\n"]
        head += [f"{name}: {value}\r\n" for name, value in headers.items()]
        head.append(f"content-length: {len(body)}\r\n\r\n")
        request = "".join(head).encode("latin-1") + body
        while self._idle:
            connection = self._idle.pop()
            try:
                return await self._exchange(connection, request)
            except _StaleConnection:
                continue
        return await self._exchange(await self._connect(), request, fresh=True)

    async def _exchange(
        self, connection: _Connection, request: bytes, *, fresh: bool = False
    ) -> tuple[int, bytes]:
        reader = connection.reader
        received_any = False
        timer = asyncio.get_running_loop().call_later(self._read_timeout_s, connection.expire)
        try:
            connection.writer.write(request)
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as exc:
                received_any = bool(exc.partial)
                raise
            received_any = True
            status, length, chunked, keep_alive = _parse_head(head)
            interim_bytes = 0
            # A 100 Continue or 103 Early Hints precedes the answer on the same connection
            # (RFC 9110 15.2); taken as the answer, the real one would be read as the next
            # request's, so the heads are skipped, bounded so a server cannot send them forever.
            while 100 <= status < 200 and status != 101:
                interim_bytes += len(head)
                if interim_bytes > MAX_HEAD_BYTES:
                    raise ValueError("too many informational responses")
                head = await reader.readuntil(b"\r\n\r\n")
                status, length, chunked, keep_alive = _parse_head(head)
            if length is not None:
                body = await reader.readexactly(length)
            elif chunked:
                body = await _read_chunked(reader)
            else:
                body = await reader.read()
                keep_alive = False
        except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            connection.close()
            # An expired exchange is a slow upstream, not a stale or broken connection: below.
            if not connection.expired:
                if not fresh and not received_any:
                    raise _StaleConnection from exc
                raise UpstreamConnectionError(
                    f"connection to {self._host_header} broke: {exc!r}"
                ) from exc
        except BaseException:
            # Cancelled mid-exchange: the connection's state is unknown.
            connection.close()
            raise
        finally:
            timer.cancel()
        if connection.expired:
            # Also when the last bytes came as it expired: a body read to the connection's end
            # would not tell a cut from the whole.
            raise TimeoutError(f"{self._host_header} did not answer in time")
        if keep_alive and len(self._idle) < self._max_idle:
            self._idle.append(connection)
        else:
            connection.close()
        return status, body

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()


class _StaleConnection(Exception):
    """A reused keep-alive connection was closed by the server before it answered."""


def _parse_head(head: bytes) -> tuple[int, int | None, bool, bool]:
    lines = head.split(b"\r\n")
    status_line = lines[0]
    if not status_line.startswith(b"HTTP/1."):
        raise ValueError(f"not an HTTP/1.x response: {status_line[:40]!r}")
    status = int(status_line[9:12])
    keep_alive = status_line.startswith(b"HTTP/1.1")
    length: int | None = None
    chunked = False
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
        elif name == b"connection":
            token = value.strip().lower()
            keep_alive = token == b"keep-alive" or (keep_alive and token != b"close")
    if chunked:
        length = None
    if status in (204, 304) or 100 <= status < 200:
        length = 0
    if status == 101:
        # Nothing here asks to switch protocols; past a 101 the bytes are no HTTP/1.1 anymore.
        keep_alive = False
    return status, length, chunked, keep_alive


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    parts: list[bytes] = []
    while True:
        size_line = await reader.readuntil(b"\r\n")
        size = int(size_line.split(b";", 1)[0].strip(), 16)
        if size == 0:
            # Trailers (rarely sent) end with an empty line.
            while (await reader.readuntil(b"\r\n")) != b"\r\n":
                pass
            return b"".join(parts)
        parts.append((await reader.readexactly(size + 2))[:-2])

"""One connection to a plain-``http://`` upstream and the answer being read on it, for
``http1.Http1Pool``.

``Answer`` is an ``asyncio.Protocol`` that decodes the answer's framing (``content-length``,
``chunked`` or the connection's close, after informational heads, which are skipped, bounded)
as the bytes arrive, and wakes its reader once per read; one timer an exchange bounds both the
silence between reads and the whole answer, moved on only when it fires. No ``StreamReader``,
no task: see ``http1.py`` for what that saves.
"""

from __future__ import annotations

import asyncio

MAX_HEAD_BYTES = 64 * 1024
MAX_CHUNK_LINE_BYTES = 4 * 1024
PAUSE_READING_BYTES = 256 * 1024
"""Body bytes buffered, unread by the caller, before the socket stops being read."""

_HEAD, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILER, _LENGTH, _TO_CLOSE, _DONE = range(8)


class UpstreamConnectionError(ConnectionError):
    """Could not connect, or the connection broke before a full answer arrived."""


class Answer(asyncio.Protocol):
    """One upstream connection, and the answer being read on it: ``status`` once ``head``
    returned, then the body through ``readany`` (as it arrives) or ``read`` (whole)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, origin: str) -> None:
        self._loop = loop
        self._origin = origin
        self._transport: asyncio.Transport | None = None
        self.lost = False
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.keep_alive = False
        self.received_any = False
        """Some byte of this exchange's answer arrived (a stale connection sends none)."""
        self._state = _HEAD
        self._unparsed = b""
        self._interim_bytes = 0
        self._remaining = 0
        self._body: list[bytes] = []
        self._buffered = 0
        self._paused = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._idle_timeout_s = 0.0
        self._deadline = 0.0
        self._last_read = 0.0

    # ---- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._last_read = self._loop.time()
        self.received_any = True
        if self._unparsed:
            data, self._unparsed = self._unparsed + data, b""
        try:
            self._feed(data)
        except ValueError as exc:
            self._fail(UpstreamConnectionError(f"{self._origin} sent a malformed answer: {exc}"))
            return
        if self._buffered > PAUSE_READING_BYTES and not self._paused:
            self._paused = True
            self._transport.pause_reading()  # type: ignore[union-attr]
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self._error is None and self._state != _DONE:
            if self._state == _TO_CLOSE and exc is None:
                self._finish()
            else:
                self._error = UpstreamConnectionError(
                    f"connection to {self._origin} broke: {exc or 'closed'}"
                )
        self._cancel_timer()
        self._wake()

    # ---- the exchange, as the pool drives it ---------------------------------------------------

    def send(self, request: bytes, idle_timeout_s: float, deadline: float) -> None:
        """Writes ``request``; the answer must arrive by ``deadline`` (loop time; 0: none) with
        no silence longer than ``idle_timeout_s`` (0: any)."""
        self._reset()
        self._idle_timeout_s = idle_timeout_s
        self._deadline = deadline
        self._last_read = self._loop.time()
        self._schedule_timer(self._last_read)
        self._transport.write(request)  # type: ignore[union-attr]

    async def head(self) -> int:
        """The answer's status, informational heads skipped."""
        while self._state == _HEAD:
            if self._error is not None:
                raise self._error
            await self._wait()
        return self.status

    async def readany(self) -> bytes:
        """The body bytes that arrived since the last call, waiting for some; ``b""`` at the
        body's end. Raises ``UpstreamConnectionError`` or ``TimeoutError``."""
        while not self._body:
            if self._state == _DONE:
                return b""
            if self._error is not None:
                raise self._error
            await self._wait()
        body = self._body
        data = body[0] if len(body) == 1 else b"".join(body)
        body.clear()
        self._buffered = 0
        if self._paused:
            self._paused = False
            self._last_read = self._loop.time()
            self._transport.resume_reading()  # type: ignore[union-attr]
        return data

    async def read(self) -> bytes:
        """The rest of the body."""
        parts = []
        while data := await self.readany():
            parts.append(data)
        return b"".join(parts)

    @property
    def reusable(self) -> bool:
        """Its answer was read to the end, and nothing stops another: a caller that left part
        of a long body unread may have left reading paused."""
        return self._state == _DONE and self.keep_alive and not self.lost and not self._paused

    def close(self) -> None:
        """Closes the connection after what was written (a request cancelled as it went out
        still reaches the upstream whole, as it did through aiohttp); the reader, if any, is
        woken by ``_fail`` already, not by the socket."""
        self._cancel_timer()
        if self._transport is not None and not self.lost:
            self._transport.close()

    # ---- framing -------------------------------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        while data:
            state = self._state
            if state == _CHUNK_DATA or state == _LENGTH:
                piece = data[: self._remaining]
                data = data[len(piece) :]
                self._take(piece)
                self._remaining -= len(piece)
                if not self._remaining:
                    if state == _LENGTH:
                        self._finish()
                    else:
                        self._state = _CHUNK_END
            elif state == _CHUNK_SIZE or state == _TRAILER or state == _CHUNK_END:
                end = data.find(b"\r\n")
                if end < 0:
                    if len(data) > MAX_CHUNK_LINE_BYTES:
                        raise ValueError("a chunk's size line is too long")
                    self._unparsed = data
                    return
                line, data = data[:end], data[end + 2 :]
                if state == _CHUNK_END:
                    if line:
                        raise ValueError("a chunk longer than its size")
                    self._state = _CHUNK_SIZE
                elif state == _TRAILER:
                    if not line:
                        self._finish()
                else:
                    size = int(line.split(b";", 1)[0].strip(), 16)
                    if size < 0:
                        raise ValueError("a negative chunk size")
                    self._remaining = size
                    self._state = _CHUNK_DATA if size else _TRAILER
            elif state == _HEAD:
                data = self._feed_head(data)
            elif state == _TO_CLOSE:
                self._take(data)
                return
            else:
                # Bytes past the end of the answer: the connection's framing cannot be trusted.
                self.keep_alive = False
                return

    def _feed_head(self, data: bytes) -> bytes:
        end = data.find(b"\r\n\r\n")
        if end < 0:
            if len(data) > MAX_HEAD_BYTES:
                raise ValueError("the head is too long")
            self._unparsed = data
            return b""
        head, data = data[: end + 4], data[end + 4 :]
        status, length, chunked, keep_alive = parse_head(head)
        if 100 <= status < 200 and status != 101:
            # A 100 Continue or 103 Early Hints precedes the answer (RFC 9110 15.2); taken as
            # the answer, the real one would be read as the next request's. Bounded, so a
            # server cannot send them forever.
            self._interim_bytes += len(head)
            if self._interim_bytes > MAX_HEAD_BYTES:
                raise ValueError("too many informational answers")
            return data
        self.status, self.keep_alive = status, keep_alive
        if chunked:
            self._state = _CHUNK_SIZE
        elif length is None:
            self._state = _TO_CLOSE
            self.keep_alive = False
        elif length:
            self._state, self._remaining = _LENGTH, length
        else:
            self._finish()
        return data

    def _take(self, piece: bytes) -> None:
        if piece:
            self._body.append(piece)
            self._buffered += len(piece)

    def _finish(self) -> None:
        self._state = _DONE
        self._cancel_timer()

    # ---- waiting and timing ------------------------------------------------------------------

    async def _wait(self) -> None:
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self.keep_alive = False
        self.close()
        self._wake()

    def _schedule_timer(self, since: float) -> None:
        when = self._deadline or float("inf")
        if self._idle_timeout_s:
            when = min(when, since + self._idle_timeout_s)
        if when != float("inf"):
            self._timer = self._loop.call_at(when, self._on_timer)

    def _on_timer(self) -> None:
        # One timer an exchange, moved on only when it fires: a read costs a clock reading,
        # not a timer's cancel and rescheduling.
        self._timer = None
        now = self._loop.time()
        if self._deadline and now >= self._deadline:
            self._fail(TimeoutError(f"{self._origin} did not answer in time"))
        elif not self._paused and now - self._last_read >= self._idle_timeout_s:
            self._fail(TimeoutError(f"{self._origin} sent nothing for {self._idle_timeout_s}s"))
        else:
            # Reading paused is our caller being slow, not the upstream.
            self._schedule_timer(now if self._paused else self._last_read)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def parse_head(head: bytes) -> tuple[int, int | None, bool, bool]:
    """``(status, content length or None, chunked, keep-alive)`` of a response head."""
    lines = head.split(b"\r\n")
    status_line = lines[0]
    if not status_line.startswith(b"HTTP/1."):
        raise ValueError(f"not an HTTP/1.x answer: {status_line[:40]!r}")
    status = int(status_line[9:12])
    keep_alive = status_line.startswith(b"HTTP/1.1")
    length: int | None = None
    chunked = False
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
            if length < 0:
                raise ValueError("a negative content-length")
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

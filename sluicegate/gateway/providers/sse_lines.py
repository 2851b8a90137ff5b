"""A streamed body's lines, as bytes, in the batches its reads bring them.

``StreamedResponse.aiter_lines`` awaits aiohttp's ``readline`` once a line: for a server-sent
event (its ``data:`` line and the blank line after it) that is two trips through aiohttp's
Python ``readuntil`` and a ``str`` decode each. Relaying thousands of open streams, that was a
good part of the gateway's CPU a chunk; here one await takes whatever the connection has
buffered and splits it in one call.
"""

from __future__ import annotations

from typing import Protocol

from aiohttp.http_exceptions import LineTooLong

from sluicegate.gateway.providers.hosted import SSE_MAX_LINE_BYTES


class Body(Protocol):
    """A body read as it arrives: aiohttp's ``StreamReader`` or ``http1_answer.Answer``."""

    async def readany(self) -> bytes: ...


class LineReader:
    """A body's lines without their ``\\n`` (a ``\\r`` before it stays), as each read completes
    them; a line longer than ``max_line`` raises ``LineTooLong``, as ``readline`` does. The last
    line needs no ``\\n``. (Not an async generator: one left at ``[DONE]`` would be closed by
    a task of its own.)"""

    __slots__ = ("_content", "_max_line", "_pending", "_size")

    def __init__(self, content: Body, max_line: int = SSE_MAX_LINE_BYTES) -> None:
        self._content = content
        self._max_line = max_line
        self._pending: list[bytes] = []
        """The start of a line no read has ended yet (in pieces: a long line comes in many)."""
        self._size = 0

    async def lines(self) -> list[bytes]:
        """The lines the next reads complete; ``[]`` at the body's end."""
        max_line = self._max_line
        while data := await self._content.readany():
            end = data.rfind(b"\n")
            if end < 0:
                self._pending.append(data)
                self._size += len(data)
                if self._size > max_line:
                    raise LineTooLong(b"".join(self._pending)[:100] + b"...", max_line)
                continue
            if self._pending:
                data = b"".join(self._pending) + data
                end += self._size
                self._pending = []
            lines = data[:end].split(b"\n")
            if len(data) > max_line:
                for line in lines:
                    if len(line) > max_line:
                        raise LineTooLong(line[:100] + b"...", max_line)
            rest = data[end + 1 :]
            if rest:
                self._pending.append(rest)
            self._size = len(rest)
            return lines
        if self._pending:
            last, self._pending = b"".join(self._pending), []
            return [last]
        return []

"""``LineReader``: a streamed body's lines as its reads complete them, as ``readline`` would
give them, long lines in many pieces included."""

from __future__ import annotations

import asyncio
from unittest import mock

import aiohttp
import pytest
from aiohttp.http_exceptions import LineTooLong

from sluicegate.gateway.providers.sse_lines import LineReader


def _body(*pieces: bytes) -> aiohttp.StreamReader:
    content = aiohttp.StreamReader(mock.Mock(_reading_paused=False), 2**16, loop=mock.Mock())
    for piece in pieces:
        content.feed_data(piece)
    content.feed_eof()
    return content


async def _all(reader: LineReader) -> list[bytes]:
    out = []
    while lines := await reader.lines():
        out += lines
    return out


async def test_lines_as_readline_gives_them() -> None:
    reader = LineReader(_body(b"data: 1\n\ndata: 2", b"2\r\n\r\n", b"data: [DONE]"))
    assert await _all(reader) == [b"data: 1", b"", b"data: 22\r", b"\r", b"data: [DONE]"]


async def test_a_long_line_in_many_pieces_is_whole() -> None:
    pieces = [b"data: "] + [b"x" * 1000] * 50 + [b"\n\n"]
    assert await _all(LineReader(_body(*pieces), max_line=60_000)) == [
        b"data: " + b"x" * 50_000,
        b"",
    ]


@pytest.mark.parametrize("whole", [False, True], ids=["pieces", "one-read"])
async def test_a_line_past_the_limit_raises(whole: bool) -> None:
    pieces = [b"data: " + b"x" * 5000 + b"\n"] if whole else [b"data: "] + [b"x" * 1000] * 5
    with pytest.raises(LineTooLong):
        await _all(LineReader(_body(*pieces), max_line=4096))


async def test_waits_for_a_read() -> None:
    content = aiohttp.StreamReader(
        mock.Mock(_reading_paused=False), 2**16, loop=asyncio.get_running_loop()
    )
    reader = LineReader(content)
    pending = asyncio.ensure_future(reader.lines())
    await asyncio.sleep(0)
    content.feed_data(b"data: 1")
    await asyncio.sleep(0)
    assert not pending.done()
    content.feed_data(b"\n\ndata: 2")
    assert await pending == [b"data: 1", b""]
    content.feed_data(b"\n")
    assert await reader.lines() == [b"data: 2"]

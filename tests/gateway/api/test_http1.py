"""The keep-alive HTTP/1.1 client against real sockets: framing, reuse, stale connections."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest

from sluicegate.gateway.providers.http1 import Http1Pool, UpstreamConnectionError

from .servers import dead_port

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], object]


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length")
    )
    return await reader.readexactly(length)


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Handler], object]]:
    servers: list[asyncio.Server] = []

    async def start(handler: Handler) -> int:
        server = await asyncio.start_server(handler, "127.0.0.1", 0)  # type: ignore[arg-type]
        servers.append(server)
        return int(server.sockets[0].getsockname()[1])

    yield start
    for server in servers:
        server.close()


async def test_content_length_chunked_and_close_framing(serve: Callable) -> None:
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while True:
            try:
                body = await _read_request(reader)
            except asyncio.IncompleteReadError:
                break
            if body == b"chunked":
                writer.write(
                    b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                    b"3\r\nabc\r\n4;ext=1\r\ndefg\r\n0\r\n\r\n"
                )
            elif body == b"close":
                writer.write(b"HTTP/1.1 201 Created\r\nconnection: close\r\n\r\nuntil-eof")
                await writer.drain()
                writer.close()
                return
            else:
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\n" + body[:4])
            await writer.drain()

    pool = Http1Pool("127.0.0.1", await serve(handler))
    assert await pool.post("/x", b"hello", {}) == (200, b"hell")
    assert await pool.post("/x", b"chunked", {}) == (200, b"abcdefg")
    assert connections == 1, "keep-alive reused the connection"
    assert await pool.post("/x", b"close", {}) == (201, b"until-eof")
    assert await pool.post("/x", b"again", {}) == (200, b"agai")
    assert connections == 2
    await pool.aclose()


async def test_stale_keep_alive_connection_is_retried_once(serve: Callable) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Answers one request, then closes the (keep-alive) connection without saying so.
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()

    pool = Http1Pool("127.0.0.1", await serve(handler))
    for _ in range(3):
        assert await pool.post("/x", b"{}", {}) == (200, b"ok")
    await pool.aclose()


async def test_refused_broken_and_slow_upstreams(serve: Callable) -> None:
    with pytest.raises(UpstreamConnectionError):
        await Http1Pool("127.0.0.1", dead_port()).post("/x", b"{}", {})

    async def breaks(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nshort")
        await writer.drain()
        writer.close()

    with pytest.raises(UpstreamConnectionError):
        await Http1Pool("127.0.0.1", await serve(breaks)).post("/x", b"{}", {})

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await asyncio.sleep(5)

    slow = Http1Pool("127.0.0.1", await serve(silent), read_timeout_s=0.2)
    with pytest.raises(TimeoutError):
        await slow.post("/x", b"{}", {})


async def test_a_body_read_to_the_end_that_stalls_times_out_not_cut(serve: Callable) -> None:
    async def stalls(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\npart of it")
        await writer.drain()
        await asyncio.sleep(5)

    pool = Http1Pool("127.0.0.1", await serve(stalls), read_timeout_s=0.2)
    with pytest.raises(TimeoutError):
        await pool.post("/x", b"{}", {})


async def test_informational_heads_are_read_past_to_the_answer(serve: Callable) -> None:
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while True:
            try:
                body = await _read_request(reader)
            except asyncio.IncompleteReadError:
                break
            writer.write(
                b"HTTP/1.1 100 Continue\r\n\r\n"
                b"HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload\r\n\r\n"
                b"HTTP/1.1 200 OK\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n"
            )
            writer.write(body)
            await writer.drain()

    pool = Http1Pool("127.0.0.1", await serve(handler))
    assert await pool.post("/x", b"first", {}) == (200, b"first")
    # Were a 1xx taken as the answer, this one would get the previous exchange's leftovers.
    assert await pool.post("/x", b"second", {}) == (200, b"second")
    assert connections == 1
    await pool.aclose()


async def test_an_unasked_101_is_final_and_its_connection_not_reused(serve: Callable) -> None:
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        body = await _read_request(reader)
        if body == b"switch":
            writer.write(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\n\r\nnot-http")
        else:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        await asyncio.sleep(1)

    pool = Http1Pool("127.0.0.1", await serve(handler))
    assert await pool.post("/x", b"switch", {}) == (101, b"")
    assert await pool.post("/x", b"plain", {}) == (200, b"ok")
    assert connections == 2
    await pool.aclose()


async def test_endless_informational_heads_break_the_exchange(serve: Callable) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        for _ in range(5000):
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    pool = Http1Pool("127.0.0.1", await serve(handler))
    with pytest.raises(UpstreamConnectionError):
        await pool.post("/x", b"{}", {})
    await pool.aclose()

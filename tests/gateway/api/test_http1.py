"""The keep-alive HTTP/1.1 client against real sockets: framing, reuse, stale connections."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import pytest

from sluicegate.gateway.providers.http1 import Http1Pool
from sluicegate.gateway.providers.http1_answer import UpstreamConnectionError

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


async def _body_pieces(answer: object) -> list[bytes]:
    pieces = []
    while piece := await answer.readany():  # type: ignore[attr-defined]
        pieces.append(piece)
    return pieces


async def test_a_stream_arrives_as_sent_and_its_connection_is_reused(serve: Callable) -> None:
    connections = 0
    go_on = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        while True:
            try:
                await _read_request(reader)
            except asyncio.IncompleteReadError:
                break
            writer.write(
                b"HTTP/1.1 100 Continue\r\n\r\n"
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                b"6\r\ndata: \r\n"
            )
            await writer.drain()
            await go_on.wait()
            # A chunk cut across writes, two chunks in one write, then the end.
            writer.write(b"5\r\nab")
            await writer.drain()
            await asyncio.sleep(0.01)
            writer.write(b"c\n\n\r\n3\r\nxyz\r\n0\r\n\r\n")
            await writer.drain()
            go_on.clear()

    pool = Http1Pool("127.0.0.1", await serve(handler))
    for _ in range(2):
        async with pool.stream("/x", b"{}", {}, idle_timeout_s=5) as answer:
            assert answer.status == 200
            assert await answer.readany() == b"data: "
            go_on.set()
            assert b"".join(await _body_pieces(answer)) == b"abc\n\nxyz"
    assert connections == 1
    await pool.aclose()


async def test_a_stream_left_before_its_end_closes_its_connection(serve: Callable) -> None:
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nhi\r\n")
        await writer.drain()
        await reader.read()  # until the client closes

    pool = Http1Pool("127.0.0.1", await serve(handler))
    for _ in range(2):
        async with pool.stream("/x", b"{}", {}, idle_timeout_s=5) as answer:
            assert await answer.readany() == b"hi"
    assert connections == 2, "a half-read answer's connection is not reused"
    await pool.aclose()


async def test_a_silent_or_overlong_stream_times_out(serve: Callable) -> None:
    async def drips(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for _ in range(100):
            writer.write(b"1\r\n.\r\n")
            await writer.drain()
            await asyncio.sleep(0.05)

    port = await serve(drips)
    pool = Http1Pool("127.0.0.1", port)
    # Reads every 50 ms: a 0.2 s silence never happens, so only the deadline ends it.
    started = asyncio.get_running_loop().time()
    async with pool.stream("/x", b"{}", {}, idle_timeout_s=0.2, deadline=time.time() + 0.5) as a:
        with pytest.raises(TimeoutError):
            await _body_pieces(a)
    assert 0.4 < asyncio.get_running_loop().time() - started < 2

    async def stalls(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1\r\n.\r\n")
        await writer.drain()
        await asyncio.sleep(5)

    pool = Http1Pool("127.0.0.1", await serve(stalls))
    async with pool.stream("/x", b"{}", {}, idle_timeout_s=0.2) as answer:
        assert await answer.readany() == b"."
        with pytest.raises(TimeoutError):
            await answer.readany()


async def test_a_stream_cut_or_malformed_is_a_broken_connection(serve: Callable) -> None:
    async def cuts(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nabc")
        await writer.drain()
        writer.close()

    pool = Http1Pool("127.0.0.1", await serve(cuts))
    async with pool.stream("/x", b"{}", {}, idle_timeout_s=5) as answer:
        with pytest.raises(UpstreamConnectionError):
            await _body_pieces(answer)

    async def garbles(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nabc\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    pool = Http1Pool("127.0.0.1", await serve(garbles))
    async with pool.stream("/x", b"{}", {}, idle_timeout_s=5) as answer:
        with pytest.raises(UpstreamConnectionError, match="malformed"):
            await answer.readany()


async def test_a_caller_that_reads_slowly_pauses_the_socket_not_the_timeout(
    serve: Callable,
) -> None:
    total = 4 * 1024 * 1024

    async def floods(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % total)
        for _ in range(total // 65536):
            writer.write(b"x" * 65536)
            await writer.drain()

    pool = Http1Pool("127.0.0.1", await serve(floods))
    received = 0
    async with pool.stream("/x", b"{}", {}, idle_timeout_s=0.1) as answer:
        while piece := await answer.readany():
            assert len(piece) <= 2 * 1024 * 1024, "reading paused near its bound"
            received += len(piece)
            await asyncio.sleep(0.15)  # longer than the idle timeout: our slowness, not its
    assert received == total
    await pool.aclose()


async def test_an_answer_left_unread_in_full_never_lends_its_connection(serve: Callable) -> None:
    big = 300 * 1024  # past the point where reading pauses, in one write

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                await _read_request(reader)
            except asyncio.IncompleteReadError:
                break
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % big + b"x" * big)
            await writer.drain()

    pool = Http1Pool("127.0.0.1", await serve(handler))
    async with pool.stream("/x", b"{}", {}, idle_timeout_s=1) as answer:
        await asyncio.sleep(0.2)  # the whole answer arrives; nothing is read
    async with pool.stream("/x", b"{}", {}, idle_timeout_s=1) as answer:
        assert len(await answer.read()) == big
    await pool.aclose()

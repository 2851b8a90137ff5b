"""``CoalescingHttpToolsProtocol``: a response's head leaves with its first body bytes, and
nothing of HTTP/1.1 changes (HEAD, 100-continue, streams, keep-alive)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from sluicegate.gateway.http.protocol import CoalescingHttpToolsProtocol
from tests.gateway.api.servers import ServerThread, read_body, serve_lifespan

BODY = b'{"ok": true}'


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        await serve_lifespan(receive, send)
        return
    received = await read_body(receive)
    if scope["path"] == "/stream":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
        await asyncio.sleep(0.5)
        await send({"type": "http.response.body", "body": b"data: 2\n\n", "more_body": False})
        return
    body = received or BODY
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    served = ServerThread(app, http=CoalescingHttpToolsProtocol).start()
    yield served
    served.stop()


def test_head_and_body_leave_in_one_send_on_a_kept_alive_connection(server: ServerThread) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        for _ in range(3):
            sock.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            reply = sock.recv(65536)
            assert reply.startswith(b"HTTP/1.1 200 OK\r\n")
            assert reply.endswith(b"\r\n\r\n" + BODY)


def test_a_head_request_gets_its_head(server: ServerThread) -> None:
    with httpx.Client(base_url=server.url) as client:
        response = client.head("/")
        assert response.status_code == 200
        assert response.headers["content-length"] == str(len(BODY))
        assert client.get("/").content == BODY  # same connection, next response intact


def test_100_continue_is_sent_before_the_body_is(server: ServerThread) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.settimeout(5)
        sock.sendall(
            b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\nexpect: 100-continue\r\n\r\n"
        )
        assert sock.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(b"hello")
        reply = sock.recv(65536)
        assert reply.startswith(b"HTTP/1.1 200 OK\r\n") and reply.endswith(b"hello")


def test_a_stream_sends_its_head_with_its_first_event_not_at_its_end(
    server: ServerThread,
) -> None:
    with httpx.Client(base_url=server.url, timeout=5) as client:
        started = time.monotonic()
        with client.stream("GET", "/stream") as response:
            events = response.iter_bytes()
            assert response.headers["transfer-encoding"] == "chunked"
            assert next(events) == b"data: 1\n\n"
            assert time.monotonic() - started < 0.4  # the stream ends half a second later
            assert b"".join(events) == b"data: 2\n\n"

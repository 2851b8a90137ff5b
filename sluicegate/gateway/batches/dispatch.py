"""A batch line run through the gateway's own app, in process, as a live request of its key.

The line's request goes into the Litestar app as an ASGI request of its endpoint, so it takes
the very path a client's request takes: the controller, admission (limits, token and money
budgets, the lease), routing with its fallbacks, the provider, settlement and usage. Only
authentication differs: the scope's state carries the batch's key (``BATCH_LINE``), which no
request from outside can set.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from litestar.types import ASGIApp, Message

from sluicegate.gateway.services import BATCH_LINE, BatchLineContext


@dataclass(slots=True)
class Answer:
    status: int
    body: bytes
    headers: dict[str, str]


async def dispatch(app: ASGIApp, path: str, body: bytes, line: BatchLineContext) -> Answer:
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 0),
        "state": {BATCH_LINE: line},
    }
    delivered = False
    # The "client" never leaves: after the body, receive waits until the app is done.
    done = asyncio.Event()
    answer = Answer(500, b"", {})
    chunks: list[bytes] = []

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            answer.status = message["status"]
            answer.headers = {
                k.decode("latin-1"): v.decode("latin-1") for k, v in message.get("headers", ())
            }
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    try:
        await app(scope, receive, send)  # type: ignore[arg-type]
    finally:
        done.set()
    answer.body = b"".join(chunks)
    return answer

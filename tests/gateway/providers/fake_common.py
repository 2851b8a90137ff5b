"""What the fake provider servers share: ASGI plumbing and one deterministic "model".

The model's answer depends only on the request. Offered tools and either a forced tool choice
or a last user turn asking "what is the weather": one call of the named (else first) tool with
arguments ``{"city": "Paris"}``. Otherwise ``n = min(max_tokens, 5)`` words ``"w0 "``,
``"w1 "``, ... (``length`` when max_tokens cut it). Prompt tokens: one per whitespace-separated
word of every text in the request. Models named ``limited`` answer 429 (``retry-after: 0``),
``down`` 503, ``bad`` 400, ``locked`` 401; every server counts calls per model. Models named
``cut-N`` answer like any other but end the body after its first N parts (a stream stopped
short); ``garble-N`` replace the N-th part with bytes no client can read.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ..api.servers import read_body, serve_lifespan

WORD_LIMIT = 5
TOOL_ARGUMENTS = {"city": "Paris"}
_FAULT = re.compile(r"\b(cut|garble)-(\d+)\b")


@dataclass
class Plan:
    """What the fake model will answer."""

    words: list[str] = field(default_factory=list)
    tool: str | None = None
    length_cut: bool = False
    stopped_by: str | None = None
    """The stop sequence that ended the answer."""


def plan(
    max_tokens: int | None,
    tools: list[str],
    forced: str | None,
    last_user: str,
    stop: list[str] | None = None,
) -> Plan:
    """``forced``: a tool name, "" for "any tool", None for the model's choice. A stop
    sequence equal to a word (without its space) ends the answer before that word."""
    if tools and (forced is not None or "what is the weather" in last_user.lower()):
        return Plan(tool=forced or tools[0])
    limit = max_tokens if max_tokens is not None else 16
    words = [f"w{i} " for i in range(min(limit, WORD_LIMIT))]
    for i, word in enumerate(words):
        if word.strip() in (stop or ()):
            return Plan(words=words[:i], stopped_by=word.strip())
    return Plan(words=words, length_cut=limit <= WORD_LIMIT)


def count_words(value: Any) -> int:
    """One token per whitespace-separated word of every string under ``text`` keys (and of
    ``value`` itself when it is a string, like Anthropic's ``system``)."""
    if isinstance(value, str):
        return len(value.split())
    if isinstance(value, dict):
        return sum(
            len(v.split())
            if k == "text" and isinstance(v, str)
            else count_words(v)
            if isinstance(v, dict | list)
            else 0
            for k, v in value.items()
        )
    if isinstance(value, list):
        return sum(count_words(v) for v in value)
    return 0


class FakeServer:
    """An ASGI app: subclasses implement ``handle``; lifespan and body reading are here."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.bodies: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await serve_lifespan(receive, send)
            return
        raw = await read_body(receive)
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        self.headers.append(headers)
        body = json.loads(raw) if raw else {}
        self.bodies.append(body)
        fault = _FAULT.search(f"{scope['path']} {body.get('model', '')}")
        if fault:
            send = _faulty(send, fault.group(1), int(fault.group(2)))
        await self.handle(scope, headers, raw, body, send)

    async def handle(
        self, scope: dict[str, Any], headers: dict[str, str], raw: bytes, body: Any, send: Any
    ) -> None:
        raise NotImplementedError


async def send_json(
    send: Any, status: int, payload: Any, headers: dict[str, str] | None = None
) -> None:
    extra = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), *extra],
        }
    )
    await send({"type": "http.response.body", "body": json.dumps(payload).encode()})


async def start_stream(send: Any, content_type: str = "text/event-stream") -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", content_type.encode())],
        }
    )


async def send_bytes(send: Any, data: bytes, more: bool = True) -> None:
    await send({"type": "http.response.body", "body": data, "more_body": more})


def sse(payload: Any, event: str | None = None) -> bytes:
    head = f"event: {event}\n" if event else ""
    return (head + "data: " + json.dumps(payload) + "\n\n").encode()


def _faulty(send: Any, fault: str, part: int) -> Any:
    """``send`` with the body ended after its first ``part`` parts (``cut``), or with its
    ``part``-th part garbled."""
    parts = 0
    ended = False

    async def faulty_send(message: dict[str, Any]) -> None:
        nonlocal parts, ended
        if message["type"] != "http.response.body":
            return await send(message)
        parts += 1
        if fault == "cut" and parts > part:
            if not ended:
                ended = True
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            return None
        if fault == "garble" and parts == part:
            message = {**message, "body": b"data: {\x00\xff garbled\n\n" + bytes(range(64))}
        await send(message)

    return faulty_send

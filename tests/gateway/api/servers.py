"""Real servers for the API tests: uvicorn in a thread, and a deterministic OpenAI upstream.

The upstream speaks OpenAI's chat/completions and completions, streaming and not. Its answer
depends only on the request: ``n = min(max_tokens, 5)`` tokens ``"w0 "``, ``"w1 "``, …;
finish ``length`` when max_tokens cut it, else ``stop``; usage reports one prompt token per
whitespace-separated word of the prompt, plus one per message. Behaviour by upstream model:
``slow`` sleeps 50 ms per token and makes 20 of them (if max_tokens allows),
``ctx`` answers 400 context_length_exceeded, ``boom`` answers 500, ``breaks`` drops the
connection after two streamed tokens, ``rich`` answers with the objects of rich_replies.py
(tool calls, refusal, logprobs, two choices). ``/v1/embeddings`` answers one vector of
``[index, length]`` per input. Every request body is kept in ``bodies``, as received.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections import Counter
from typing import Any

import uvicorn

from . import rich_replies


async def serve_lifespan(receive: Any, send: Any) -> None:
    """An ASGI lifespan answered: started when asked, stopped when told."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def read_body(receive: Any) -> bytes:
    """An ASGI request's whole body."""
    raw = b""
    while True:
        message = await receive()
        raw += message.get("body", b"")
        if not message.get("more_body"):
            return raw


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def dead_port() -> int:
    """A port nothing listens on (connections are refused)."""
    return free_port()


class ServerThread:
    """Serves an ASGI app with uvicorn on 127.0.0.1 from a background thread."""

    def __init__(self, app: Any, port: int | None = None, http: Any = "auto") -> None:
        self.port = port or free_port()
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, lifespan="auto", log_level="warning", http=http
        )
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(15)


def _prompt_tokens(body: dict[str, Any]) -> int:
    if "messages" in body:
        return sum(len(str(m.get("content") or "").split()) + 1 for m in body["messages"])
    prompt = body.get("prompt")
    return len(prompt) if isinstance(prompt, list) else len(str(prompt).split())


class Upstream:
    """A small OpenAI-compatible ASGI app; counts what it saw."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.disconnected = 0
        self.tokens_sent = 0
        self.traceparents: list[str | None] = []
        self.bodies: list[tuple[str, dict[str, Any]]] = []
        """(path, body) of every request, as it arrived."""

    def last_body(self, model: str) -> dict[str, Any]:
        return next(body for _, body in reversed(self.bodies) if body.get("model") == model)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await serve_lifespan(receive, send)
            return
        raw = await read_body(receive)
        body = json.loads(raw)
        self.bodies.append((scope["path"], body))
        model = body["model"]
        self.calls[model] += 1
        headers = dict(scope["headers"])
        traceparent = headers.get(b"traceparent")
        self.traceparents.append(traceparent.decode() if traceparent else None)
        if model == "ctx":
            error = {
                "message": "This model's maximum context length is 16 tokens.",
                "type": "invalid_request_error",
                "param": "messages",
                "code": "context_length_exceeded",
            }
            return await _json(send, 400, {"error": error})
        if scope["path"].endswith("/embeddings"):
            return await _json(send, 200, _embeddings(body))
        if model == "rich":
            return await _rich(send, body)
        if model == "boom":
            return await _json(send, 500, {"error": {"message": "upstream exploded"}})
        chat = scope["path"].endswith("/chat/completions")
        max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        limit = 20 if model == "slow" else 5
        n = min(max_tokens, limit)
        finish = "length" if max_tokens <= limit else "stop"
        words = [f"w{i} " for i in range(n)]
        usage = {"prompt_tokens": _prompt_tokens(body), "completion_tokens": n}
        usage["total_tokens"] = usage["prompt_tokens"] + n
        ident, created = f"up-{time.time_ns()}", int(time.time())
        if not body.get("stream"):
            if model == "slow":
                await asyncio.sleep(0.05 * n)  # as long as the same answer streamed
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "logprobs": None}
            if chat:
                choice["message"] = {"role": "assistant", "content": "".join(words)}
            else:
                choice["text"] = "".join(words)
            self.tokens_sent += n
            kind = "chat.completion" if chat else "text_completion"
            return await _json(
                send,
                200,
                {
                    "id": ident,
                    "object": kind,
                    "created": created,
                    "model": model,
                    "choices": [choice],
                    "usage": usage,
                },
            )
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        watcher = asyncio.create_task(watch())

        def event(payload: dict[str, Any]) -> dict[str, Any]:
            data = b"data: " + json.dumps(payload).encode() + b"\n\n"
            return {"type": "http.response.body", "body": data, "more_body": True}

        def chunk(delta: str | None, finish_reason: str | None) -> dict[str, Any]:
            if chat:
                choice = {
                    "index": 0,
                    "delta": {"content": delta} if delta else {},
                    "logprobs": None,
                    "finish_reason": finish_reason,
                }
            else:
                choice = {"index": 0, "text": delta or "", "finish_reason": finish_reason}
            return {
                "id": ident,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created,
                "model": model,
                "choices": [choice],
            }

        try:
            if chat:
                # OpenAI's first chunk names the role.
                opening = chunk(None, None)
                opening["choices"][0]["delta"] = {"role": "assistant", "content": ""}
                await send(event(opening))
            for i, word in enumerate(words):
                if model == "breaks" and i == 2:
                    raise ConnectionAbortedError("dropping the connection on purpose")
                if model == "slow":
                    try:
                        await asyncio.wait_for(gone.wait(), 0.05)
                    except TimeoutError:
                        pass
                if gone.is_set():
                    self.disconnected += 1
                    return
                await send(event(chunk(word, None)))
                self.tokens_sent += 1
            await send(event(chunk(None, finish)))
            if (body.get("stream_options") or {}).get("include_usage"):
                await send(
                    event(
                        {
                            "id": ident,
                            "object": "chat.completion.chunk" if chat else "text_completion",
                            "created": created,
                            "model": model,
                            "choices": [],
                            "usage": usage,
                        }
                    )
                )
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        finally:
            watcher.cancel()


async def _json(send: Any, status: int, payload: dict[str, Any]) -> None:
    data = json.dumps(payload).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": data})


def _embeddings(body: dict[str, Any]) -> dict[str, Any]:
    inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
    tokens = sum(len(str(text).split()) for text in inputs)
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": [float(i), float(len(str(text)))]}
            for i, text in enumerate(inputs)
        ],
        "model": body["model"],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


async def _rich(send: Any, body: dict[str, Any]) -> None:
    if not body.get("stream"):
        return await _json(send, 200, rich_replies.COMPLETION)
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream")],
        }
    )
    include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
    for chunk in rich_replies.chunks(include_usage):
        data = b"data: " + json.dumps(chunk).encode() + b"\n\n"
        await send({"type": "http.response.body", "body": data, "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

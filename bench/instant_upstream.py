"""An OpenAI-style upstream that answers every chat request at once with the same completion
(raw asyncio, HTTP/1.1 keep-alive): what the gateway benches put behind a gateway, so that
all they time is the gateway. ``python bench/instant_upstream.py PORT`` serves until SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys

from load_client import content_length

MODEL = "bench"
UPSTREAM_BODY = json.dumps(
    {
        "id": "chatcmpl-upstream",
        "object": "chat.completion",
        "created": 1700000000,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello there, friend!"},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14},
    }
).encode()
UPSTREAM_RESPONSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
    + str(len(UPSTREAM_BODY)).encode()
    + b"\r\n\r\n"
    + UPSTREAM_BODY
)


def use_uvloop() -> None:
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


class _UpstreamProtocol(asyncio.Protocol):
    """HTTP/1.1 keep-alive; every complete request gets the same completion at once."""

    def __init__(self) -> None:
        self._buffer = b""
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while (end := self._buffer.find(b"\r\n\r\n")) >= 0:
            length = content_length(self._buffer[:end])
            total = end + 4 + length
            if len(self._buffer) < total:
                return
            self._buffer = self._buffer[total:]
            assert self._transport is not None
            self._transport.write(UPSTREAM_RESPONSE)


def serve_upstream(port: int) -> None:
    use_uvloop()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(_UpstreamProtocol, "127.0.0.1", port, backlog=1024)
        async with server:
            await server.serve_forever()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())


if __name__ == "__main__":
    serve_upstream(int(sys.argv[1]))

"""Many open SSE streams through one gateway process: does each still start and flow on time?

An OpenAI-compatible upstream (raw asyncio, its own process) answers every streamed chat
request with a chunk at once and then one on each tick of a shared ``--interval`` clock,
``--chunks`` in all. ``sluicegate gateway`` (one process, on the PostgreSQL and Redis of
``SLUICEGATE_DATABASE_URL`` / ``SLUICEGATE_REDIS_URL``, a scratch database) relays them; this
process opens ``--streams`` of them (started evenly over ``--ramp-s``) for each size asked, over
bare HTTP/1.1 connections, timing each chunk's arrival.

Per size: streams completed and failed; time to first chunk p50/p99 (the upstream sends its
first at once, so this is what the gateway adds, admission included); the added inter-chunk
gap p99 (each gap after the first chunk minus the upstream's own tick); and the gateway's CPU
per relayed chunk (its whole CPU time over the run, admission and settlement included, over
the chunks the clients received). The last line is one JSON object: ``sizes`` keyed by the
stream count.

    python bench/streams.py                       # 1,000 / 4,000 / 10,000 streams
    python bench/streams.py --sizes 200 --chunks 5 --interval 0.5   # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

import yaml
from gateway_overhead import (
    _create_key,
    cpu_seconds,
    free_port,
    gateway_command,
    process,
    wait_listening,
)
from gateway_overhead import wait_ready as wait_http
from instant_upstream import MODEL, use_uvloop
from load_client import percentile

from sluicegate.gateway.db.scratch import scratch_database

CHUNK = (
    b'data: {"id":"c","object":"chat.completion.chunk","created":0,"model":"bench",'
    b'"choices":[{"index":0,"delta":{"content":"tok "}}]}\n\n'
)
CONTENT = b'"content":"'
"""Each chunk with output carries this once (the closing chunk has none)."""
LAST = (
    b'data: {"id":"c","object":"chat.completion.chunk","created":0,"model":"bench",'
    b'"choices":[{"index":0,"delta":{},"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":9,"completion_tokens":%d,"total_tokens":%d}}\n\ndata: [DONE]\n\n'
)


# ---- the upstream (its own process) ------------------------------------------------------------


class _Drip(asyncio.Protocol):
    def __init__(self, streams: set[_Drip], chunks: int) -> None:
        self._streams = streams
        self._chunks = chunks
        self._buffer = b""
        self._transport: asyncio.Transport | None = None
        self.left = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        end = self._buffer.find(b"\r\n\r\n")
        if end < 0 or self.left:
            return
        head = self._buffer[:end].lower()
        length = (
            int(head.split(b"content-length:")[1].split(b"\r\n")[0])
            if b"content-length:" in head
            else 0
        )
        if len(self._buffer) < end + 4 + length:
            return
        assert self._transport is not None
        self._transport.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
            + CHUNK
        )
        self.left = self._chunks - 1
        self._streams.add(self)

    def tick(self) -> None:
        assert self._transport is not None
        self.left -= 1
        if self.left > 0:
            self._transport.write(CHUNK)
            return
        n = self._chunks
        self._transport.write(CHUNK + LAST % (n, n + 9))
        self._transport.close()
        self._streams.discard(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._streams.discard(self)


async def upstream(port: int, interval: float, chunks: int) -> None:
    streams: set[_Drip] = set()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: _Drip(streams, chunks), "127.0.0.1", port, backlog=16384
    )
    async with server:
        while True:
            await asyncio.sleep(interval - time.monotonic() % interval)
            for stream in list(streams):
                stream.tick()


# ---- the clients ---------------------------------------------------------------------------------


class Stream:
    __slots__ = ("arrivals", "done", "error", "sent")

    def __init__(self) -> None:
        self.sent = 0.0
        self.arrivals: list[float] = []
        self.done = False
        self.error = ""


async def one_stream(port: int, request: bytes, stream: Stream, timeout_s: float) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            stream.sent = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                stream.error = head.split(b"\r\n", 1)[0].decode(errors="replace")
                writer.close()
                return
            tail = b""
            while piece := await reader.read(65536):
                now = time.perf_counter()
                # Counted in the new bytes and the end of the last read, so that a marker cut
                # in two by a read boundary is counted once.
                window = tail + piece
                stream.arrivals += [now] * (window.count(CONTENT) - tail.count(CONTENT))
                if b"data: [DONE]" in window:
                    stream.done = True
                    break
                tail = window[-16:]
            writer.close()
    except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
        stream.error = type(exc).__name__


async def run_size(
    port: int, request: bytes, count: int, ramp_s: float, timeout_s: float
) -> list[Stream]:
    streams = [Stream() for _ in range(count)]
    tasks = []
    began = time.perf_counter()
    for i, stream in enumerate(streams):
        start_at = began + ramp_s * i / count
        delay = start_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one_stream(port, request, stream, timeout_s)))
    await asyncio.gather(*tasks)
    return streams


def summarize(streams: list[Stream], interval: float, cpu_s: float) -> dict[str, float | int]:
    done = [s for s in streams if s.done]
    first = [(s.arrivals[0] - s.sent) * 1000 for s in done if s.arrivals]
    added_gaps = [
        (b - a - interval) * 1000
        for s in done
        for a, b in zip(s.arrivals[1:], s.arrivals[2:], strict=False)
    ]
    chunks = sum(len(s.arrivals) for s in streams)
    errors: dict[str, int] = {}
    for s in streams:
        if not s.done:
            errors[s.error or "incomplete"] = errors.get(s.error or "incomplete", 0) + 1
    return {
        "streams": len(streams),
        "completed": len(done),
        "failed": len(streams) - len(done),
        "errors": errors,
        "ttfc_p50_ms": round(percentile(first, 0.5), 1) if first else None,
        "ttfc_p99_ms": round(percentile(first, 0.99), 1) if first else None,
        "added_gap_p99_ms": round(percentile(added_gaps, 0.99), 1) if added_gaps else None,
        "chunks": chunks,
        "gateway_cpu_s": round(cpu_s, 2),
        "gateway_cpu_us_per_chunk": round(cpu_s / chunks * 1e6, 1) if chunks else None,
    }


def time_sizes(
    port: int, pid: int, label: str, request: bytes, sizes: list[int],
    args: argparse.Namespace, timeout_s: float,
) -> dict[str, object]:  # fmt: skip
    """Each size's streams through the relay listening on ``port`` (process ``pid``)."""
    out: dict[str, object] = {}
    for size in sizes:
        before = cpu_seconds(pid)
        streams = asyncio.run(run_size(port, request, size, args.ramp_s, timeout_s))
        out[str(size)] = summary = summarize(streams, args.interval, cpu_seconds(pid) - before)
        print(f"{size} streams{label}: {json.dumps(summary)}", flush=True)
    return out


def floor(
    upstream_port: int, request: bytes, sizes: list[int], args: argparse.Namespace,
    timeout_s: float,
) -> dict[str, object]:  # fmt: skip
    """The same sizes through ``relay_floor.py``: the socket calls and the event loop alone."""
    port = free_port()
    relay = Path(__file__).with_name("relay_floor.py")
    with process([sys.executable, str(relay), str(port), str(upstream_port)]) as proc:
        wait_listening(port)
        return time_sizes(port, proc.pid, ", relay floor", request, sizes, args, timeout_s)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,4000,10000", help="stream counts, in turn")
    parser.add_argument("--chunks", type=int, default=20, help="chunks per stream")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between chunks")
    parser.add_argument("--ramp-s", type=float, default=5.0, help="streams start over this long")
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also time bench/relay_floor.py (bytes in, bytes out) on the same streams",
    )
    parser.add_argument("--upstream", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    use_uvloop()
    if args.upstream:
        with contextlib.suppress(KeyboardInterrupt):  # how the bench stops it
            asyncio.run(upstream(args.upstream, args.interval, args.chunks))
        return 0

    admin_url = os.environ.get(
        "SLUICEGATE_DATABASE_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
    )
    redis_url = os.environ.get("SLUICEGATE_REDIS_URL", "redis://127.0.0.1:6379/0")
    upstream_port, gateway_port = free_port(), free_port()
    config = Path(tempfile.mkdtemp(prefix="sg-streams-")) / "models.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "models": [
                    {
                        "name": MODEL,
                        "deployments": [
                            {
                                "provider": "openai",
                                "base_url": f"http://127.0.0.1:{upstream_port}/v1",
                                "model": MODEL,
                            }
                        ],
                    }
                ]
            }
        )
    )
    body = json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "stream": True,
         "max_tokens": args.chunks + 1}
    ).encode()  # fmt: skip
    sizes = [int(s) for s in args.sizes.split(",")]
    timeout_s = args.ramp_s + args.chunks * args.interval + 120
    result: dict[str, object] = {
        "chunks_per_stream": args.chunks,
        "interval_s": args.interval,
        "ramp_s": args.ramp_s,
        "sizes": {},
    }
    usage_stream = f"sg:usage:streams:{uuid.uuid4().hex[:8]}"
    with scratch_database(admin_url, prefix="sg_streams") as database_url:
        api_key = asyncio.run(_create_key(database_url))
        request = (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{gateway_port}\r\n"
            f"authorization: Bearer {api_key}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
        ).encode() + body
        env = {
            **os.environ,
            "SLUICEGATE_DATABASE_URL": database_url,
            "SLUICEGATE_REDIS_URL": redis_url,
            "SLUICEGATE_CONFIG": str(config),
            "SLUICEGATE_USAGE_STREAM": usage_stream,
            "SLUICEGATE_MASTER_KEY": "bench-master",
        }
        upstream_cmd = [sys.executable, __file__, "--upstream", str(upstream_port),
                        "--interval", str(args.interval), "--chunks", str(args.chunks)]  # fmt: skip
        with (
            process(upstream_cmd),
            process(gateway_command(gateway_port, 1), env) as gateway,
        ):
            wait_http(f"http://127.0.0.1:{gateway_port}/health/live", gateway)
            wait_listening(upstream_port)
            asyncio.run(run_size(gateway_port, request, 10, 0.1, timeout_s))  # warm up
            result["sizes"] = time_sizes(
                gateway_port, gateway.pid, "", request, sizes, args, timeout_s
            )
            if args.floor:
                result["floor"] = floor(upstream_port, request, sizes, args, timeout_s)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

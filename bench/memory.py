"""Does one gateway process keep a flat memory under long mixed traffic?

An OpenAI-compatible upstream (raw asyncio, its own process) answers every chat request at
once: a plain completion, or for ``"stream": true`` a whole SSE stream of ``--chunks`` chunks
with usage. ``sluicegate gateway`` (one process, on the PostgreSQL and Redis of
``SLUICEGATE_DATABASE_URL`` / ``SLUICEGATE_REDIS_URL``, a scratch database and a usage stream
of its own) relays them to ``--clients`` clients here, each on its own keep-alive
connection, alternating plain and streamed requests, for ``--minutes``. Every ``--every-s``
seconds the gateway's resident set (VmRSS, from /proc) is sampled and printed.

Growth is the last sample minus the first one after ``--warmup-s`` (caches, pools and the
allocator's arenas fill during warm-up); the least-squares slope over the samples after
warm-up, in MB per 10 minutes, is beside it, as is the peak. Target: growth < 5 MB over a
30-minute run. The last line is one JSON object.

    python bench/memory.py                                # 30 minutes, 32 clients
    python bench/memory.py --minutes 2 --warmup-s 30      # a quick look
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
from gateway_overhead import _create_key, cpu_seconds, free_port, gateway_command, process
from gateway_overhead import wait_ready as wait_http
from instant_upstream import MODEL, UPSTREAM_RESPONSE, use_uvloop
from load_client import content_length

from sluicegate.gateway.db.scratch import scratch_database

CHUNK = (
    b'data: {"id":"c","object":"chat.completion.chunk","created":0,"model":"bench",'
    b'"choices":[{"index":0,"delta":{"content":"tok "}}]}\n\n'
)
LAST = (
    b'data: {"id":"c","object":"chat.completion.chunk","created":0,"model":"bench",'
    b'"choices":[{"index":0,"delta":{},"finish_reason":"stop"}],'
    b'"usage":{"prompt_tokens":9,"completion_tokens":%d,"total_tokens":%d}}\n\ndata: [DONE]\n\n'
)


# ---- the upstream (its own process) ------------------------------------------------------------


def stream_response(chunks: int) -> bytes:
    body = CHUNK * chunks + LAST % (chunks, chunks + 9)
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


class _Upstream(asyncio.Protocol):
    """HTTP/1.1 keep-alive: each complete request answered at once, streamed or not."""

    def __init__(self, streamed: bytes) -> None:
        self._buffer = b""
        self._streamed = streamed
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while (end := self._buffer.find(b"\r\n\r\n")) >= 0:
            total = end + 4 + content_length(self._buffer[:end])
            if len(self._buffer) < total:
                return
            body, self._buffer = self._buffer[end + 4 : total], self._buffer[total:]
            assert self._transport is not None
            streamed = b'"stream":true' in body.replace(b" ", b"")
            self._transport.write(self._streamed if streamed else UPSTREAM_RESPONSE)


async def upstream(port: int, chunks: int) -> None:
    streamed = stream_response(chunks)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Upstream(streamed), "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


# ---- the clients -------------------------------------------------------------------------------


async def read_response(reader: asyncio.StreamReader) -> bytes:
    """One response off a keep-alive connection: by content-length, or chunk by chunk."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = head.split(b" ", 2)[1]
    if status != b"200":
        raise RuntimeError(f"gateway answered {status.decode()}: {head[:200]!r}")
    if b"transfer-encoding: chunked" not in head.lower():
        return await reader.readexactly(content_length(head))
    body = b""
    while True:
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        body += await reader.readexactly(size + 2)
        if size == 0:
            return body


class Counts:
    def __init__(self) -> None:
        self.plain = 0
        self.streamed = 0
        self.failed = 0


async def client(port: int, requests: tuple[bytes, bytes], deadline: float, counts: Counts) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    turn = 0
    try:
        while time.monotonic() < deadline:
            streamed = turn % 2 == 1
            turn += 1
            writer.write(requests[streamed])
            try:
                body = await asyncio.wait_for(read_response(reader), 30)
            except (RuntimeError, OSError, TimeoutError, asyncio.IncompleteReadError, ValueError):
                counts.failed += 1
                writer.close()
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                continue
            if streamed and b"[DONE]" in body:
                counts.streamed += 1
            elif not streamed and b'"choices"' in body:
                counts.plain += 1
            else:
                counts.failed += 1
    finally:
        writer.close()


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


async def drive(
    port: int, requests: tuple[bytes, bytes], args: argparse.Namespace, pid: int
) -> tuple[list[tuple[float, float]], Counts]:
    counts = Counts()
    started = time.monotonic()
    deadline = started + args.minutes * 60
    clients = [
        asyncio.create_task(client(port, requests, deadline, counts)) for _ in range(args.clients)
    ]
    samples: list[tuple[float, float]] = []
    while time.monotonic() < deadline:
        await asyncio.sleep(min(args.every_s, max(0.0, deadline - time.monotonic())))
        elapsed = time.monotonic() - started
        samples.append((elapsed, rss_mb(pid)))
        done = counts.plain + counts.streamed
        print(
            f"{elapsed:7.0f} s  rss {samples[-1][1]:8.2f} MB  requests {done:,} "
            f"(failed {counts.failed})",
            file=sys.stderr,
            flush=True,
        )
    await asyncio.gather(*clients, return_exceptions=True)
    return samples, counts


def slope_per_10_min(samples: list[tuple[float, float]]) -> float:
    if len(samples) < 2:
        return 0.0
    n = len(samples)
    mean_t = sum(t for t, _ in samples) / n
    mean_m = sum(m for _, m in samples) / n
    var = sum((t - mean_t) ** 2 for t, _ in samples)
    cov = sum((t - mean_t) * (m - mean_m) for t, m in samples)
    return cov / var * 600 if var else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--warmup-s", type=float, default=120.0)
    parser.add_argument("--every-s", type=float, default=10.0, help="between RSS samples")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--chunks", type=int, default=8, help="chunks per streamed answer")
    parser.add_argument("--upstream", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    use_uvloop()
    if args.upstream:
        with contextlib.suppress(KeyboardInterrupt):  # how the bench stops it
            asyncio.run(upstream(args.upstream, args.chunks))
        return 0

    admin_url = os.environ.get(
        "SLUICEGATE_DATABASE_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
    )
    redis_url = os.environ.get("SLUICEGATE_REDIS_URL", "redis://127.0.0.1:6379/0")
    upstream_port, gateway_port = free_port(), free_port()
    config = Path(tempfile.mkdtemp(prefix="sg-memory-")) / "models.yaml"
    deployment = {"provider": "openai", "base_url": f"http://127.0.0.1:{upstream_port}/v1",
                  "model": MODEL}  # fmt: skip
    config.write_text(yaml.safe_dump({"models": [{"name": MODEL, "deployments": [deployment]}]}))
    with scratch_database(admin_url, prefix="sg_memory") as database_url:
        api_key = asyncio.run(_create_key(database_url))

        def request(streamed: bool) -> bytes:
            body = json.dumps(
                {"model": MODEL, "messages": [{"role": "user", "content": "go"}],
                 "stream": streamed, "max_tokens": args.chunks + 1}
            ).encode()  # fmt: skip
            return (
                f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{gateway_port}\r\n"
                f"authorization: Bearer {api_key}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n\r\n"
            ).encode() + body

        env = {
            **os.environ,
            "SLUICEGATE_DATABASE_URL": database_url,
            "SLUICEGATE_REDIS_URL": redis_url,
            "SLUICEGATE_CONFIG": str(config),
            "SLUICEGATE_USAGE_STREAM": f"sg:usage:memory:{uuid.uuid4().hex[:8]}",
            "SLUICEGATE_MASTER_KEY": "bench-master",
        }
        upstream_cmd = [sys.executable, __file__, "--upstream", str(upstream_port),
                        "--chunks", str(args.chunks)]  # fmt: skip
        with (
            process(upstream_cmd),
            process(gateway_command(gateway_port, 1), env) as gateway,
        ):
            wait_http(f"http://127.0.0.1:{gateway_port}/health/live", gateway)
            cpu_before = cpu_seconds(gateway.pid)
            samples, counts = asyncio.run(
                drive(gateway_port, (request(False), request(True)), args, gateway.pid)
            )
            cpu_s = cpu_seconds(gateway.pid) - cpu_before
    settled = [(t, m) for t, m in samples if t >= args.warmup_s]
    result = {
        "minutes": args.minutes,
        "clients": args.clients,
        "requests_plain": counts.plain,
        "requests_streamed": counts.streamed,
        "failed": counts.failed,
        "gateway_cpu_s": round(cpu_s, 1),
        "rss_start_mb": round(samples[0][1], 2) if samples else None,
        "rss_after_warmup_mb": round(settled[0][1], 2) if settled else None,
        "rss_end_mb": round(samples[-1][1], 2) if samples else None,
        "rss_peak_mb": round(max(m for _, m in samples), 2) if samples else None,
        "growth_after_warmup_mb": round(settled[-1][1] - settled[0][1], 2) if settled else None,
        "slope_mb_per_10_min": round(slope_per_10_min(settled), 3),
        "target_growth_mb": 5,
        "samples": [[round(t), round(m, 2)] for t, m in samples],
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

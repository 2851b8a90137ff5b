"""The gateway's hand-written HTTP/1.1 client (sluicegate/gateway/providers/http1.py) against aiohttp
(its C parser) and httpx, on the same instant local upstream in one run.

Each client sends the same small JSON POST the gateway sends upstream: ``--requests`` one at a
time, then the same number from ``--concurrency`` tasks. The clients take turns in rounds (the
order rotating) and the figure kept per client is the median over rounds of CPU time per
request (this process's user+system time, so other load on the machine barely moves it) and of
wall time per sequential request. Then the same for streams (``--streams`` open at once, each
``--chunks`` SSE events dripped one a read by ``bench/streams.py``'s upstream, read by lines as
the gateway reads them): CPU per relayed chunk, the stream's connection included, beside the
floor under any client (a protocol that only counts the events it reads). Last line:
JSON with both per client and the ratios against http1; keeping http1 is worth it only if it
beats aiohttp by a margin that matters.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

BODY = json.dumps(
    {"model": "bench", "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 16}
).encode()
HEADERS = {"content-type": "application/json", "authorization": "Bearer sk-upstream"}


def _cpu() -> float:
    times = os.times()
    return times.user + times.system


async def _run(
    send: Callable[[], Awaitable[int]], requests: int, concurrency: int
) -> dict[str, float]:
    started_cpu, started = _cpu(), time.perf_counter()
    for _ in range(requests):
        assert await send() == 200
    sequential_wall = (time.perf_counter() - started) / requests
    sequential_cpu = (_cpu() - started_cpu) / requests

    async def worker(count: int) -> None:
        for _ in range(count):
            assert await send() == 200

    started_cpu = _cpu()
    await asyncio.gather(*(worker(requests // concurrency) for _ in range(concurrency)))
    concurrent_cpu = (_cpu() - started_cpu) / (requests // concurrency * concurrency)
    return {
        "sequential_wall_ms": sequential_wall * 1000,
        "sequential_cpu_ms": sequential_cpu * 1000,
        "concurrent_cpu_ms": concurrent_cpu * 1000,
    }


async def measure(port: int, requests: int, concurrency: int, rounds: int) -> dict[str, object]:
    import aiohttp
    import httpx

    from sluicegate.gateway.providers.http1 import Http1Pool

    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    pool = Http1Pool("127.0.0.1", port, connect_timeout_s=5, read_timeout_s=30)
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=200))
    client = httpx.AsyncClient(limits=httpx.Limits(max_connections=200))

    async def http1() -> int:
        status, _ = await pool.post("/v1/chat/completions", BODY, HEADERS)
        return status

    async def with_aiohttp() -> int:
        async with session.post(url, data=BODY, headers=HEADERS) as response:
            await response.read()
            return response.status

    async def with_httpx() -> int:
        response = await client.post(url, content=BODY, headers=HEADERS)
        return response.status_code

    clients = {"http1": http1, "aiohttp": with_aiohttp, "httpx": with_httpx}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in clients}
    for send in clients.values():  # warm up connections
        await _run(send, 200, concurrency)
    names = list(clients)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            results[name].append(await _run(clients[name], requests, concurrency))
    await pool.aclose()
    await session.close()
    await client.aclose()
    summary: dict[str, object] = {
        name: {key: round(statistics.median(run[key] for run in runs), 4) for key in runs[0]}
        for name, runs in results.items()
    }
    for name in ("aiohttp", "httpx"):
        summary[f"{name}_cpu_vs_http1"] = round(
            summary[name]["sequential_cpu_ms"] / summary["http1"]["sequential_cpu_ms"],
            2,  # type: ignore[index]
        )
    return summary


async def measure_streams(port: int, streams: int, chunks: int, rounds: int) -> dict[str, object]:
    """CPU per streamed chunk: http1's ``stream`` against aiohttp, as the gateway reads each."""
    import aiohttp

    from sluicegate.gateway.providers.http1 import Http1Pool
    from sluicegate.gateway.providers.sse_lines import LineReader

    body = json.dumps({"model": "bench", "stream": True, "messages": []}).encode()
    pool = Http1Pool("127.0.0.1", port, connect_timeout_s=5)
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    timeout = aiohttp.ClientTimeout(sock_connect=5, sock_read=30)

    async def events(reader: LineReader) -> int:
        count = 0
        while lines := await reader.lines():
            for line in lines:
                if line.startswith(b"data:"):
                    if line == b"data: [DONE]":
                        return count
                    count += 1
        return count

    async def http1() -> int:
        async with pool.stream("/v1/chat/completions", body, HEADERS, idle_timeout_s=30) as a:
            return await events(LineReader(a))

    async def with_aiohttp() -> int:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        async with session.post(url, data=body, headers=HEADERS, timeout=timeout) as reply:
            return await events(LineReader(reply.content))

    class Counter(asyncio.Protocol):
        """The floor under any client: bytes read and events counted, nothing parsed."""

        def __init__(self, done: asyncio.Future[int]) -> None:
            self.done = done
            self.count = 0

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            transport.write(  # type: ignore[attr-defined]
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )

        def data_received(self, data: bytes) -> None:
            self.count += data.count(b"data:")
            if b"data: [DONE]" in data:
                self.done.set_result(self.count - 1)

    async def socket_only() -> int:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[int] = loop.create_future()
        transport, _ = await loop.create_connection(lambda: Counter(done), "127.0.0.1", port)
        try:
            return await done
        finally:
            transport.close()

    clients = {"http1": http1, "aiohttp": with_aiohttp, "socket_only": socket_only}
    per_chunk: dict[str, list[float]] = {name: [] for name in clients}
    for r in range(rounds + 1):
        names = list(clients)
        for name in names[r % 3 :] + names[: r % 3]:
            started = _cpu()
            counts = await asyncio.gather(*(clients[name]() for _ in range(streams)))
            assert counts == [chunks] * streams, "every event of every stream arrived"
            if r:  # the first round warms up
                per_chunk[name].append((_cpu() - started) / (streams * chunks) * 1e6)
    await pool.aclose()
    await session.close()
    summary: dict[str, object] = {
        f"{name}_us_per_chunk": round(statistics.median(runs), 1)
        for name, runs in per_chunk.items()
    }
    summary["aiohttp_stream_cpu_vs_http1"] = round(
        statistics.median(per_chunk["aiohttp"]) / statistics.median(per_chunk["http1"]), 2
    )
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--streams", type=int, default=200, help="streams open at once")
    parser.add_argument("--chunks", type=int, default=50, help="events per stream")
    args = parser.parse_args()
    port, drip_port = _free_port(), _free_port()
    here = Path(__file__).parent
    drip = [sys.executable, str(here / "streams.py"), "--upstream", str(drip_port),
            "--interval", "0.02", "--chunks", str(args.chunks)]  # fmt: skip
    upstreams = [
        subprocess.Popen([sys.executable, str(here / "instant_upstream.py"), str(port)]),
        subprocess.Popen(drip),
    ]
    try:
        for listening in (port, drip_port):
            _wait_listening(listening)
        with contextlib.suppress(ImportError):
            import uvloop

            asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        result = asyncio.run(measure(port, args.requests, args.concurrency, args.rounds))
        # Each stream carries ``--chunks`` events and a last one with the usage.
        result["streams"] = asyncio.run(
            measure_streams(drip_port, args.streams, args.chunks + 1, args.rounds)
        )
    finally:
        for upstream in upstreams:
            upstream.send_signal(signal.SIGINT)
            upstream.wait(10)
    for name in ("http1", "aiohttp", "httpx", "streams"):
        print(f"{name}: {result[name]}")
    print(json.dumps(result))
    return 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_listening(port: int) -> None:
    for _ in range(100):
        with contextlib.suppress(OSError):
            socket.create_connection(("127.0.0.1", port), 1).close()
            return
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())

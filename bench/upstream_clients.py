"""The gateway's hand-written HTTP/1.1 client (sluicegate/gateway/providers/http1.py) against aiohttp
(its C parser) and httpx, on the same instant local upstream in one run.

Each client sends the same small JSON POST the gateway sends upstream: ``--requests`` one at a
time, then the same number from ``--concurrency`` tasks. The clients take turns in rounds (the
order rotating) and the figure kept per client is the median over rounds of CPU time per
request (this process's user+system time, so other load on the machine barely moves it) and of
wall time per sequential request. Last line: JSON with both per client and the ratios against
http1; keeping http1 is worth it only if it beats aiohttp by a margin that matters.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script = Path(__file__).with_name("instant_upstream.py")
    upstream = subprocess.Popen([sys.executable, str(script), str(port)])
    try:
        for _ in range(100):
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", port), 1).close()
                break
            time.sleep(0.05)
        with contextlib.suppress(ImportError):
            import uvloop

            asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        result = asyncio.run(measure(port, args.requests, args.concurrency, args.rounds))
    finally:
        upstream.terminate()
        upstream.wait(10)
    for name in ("http1", "aiohttp", "httpx"):
        print(f"{name}: {result[name]}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

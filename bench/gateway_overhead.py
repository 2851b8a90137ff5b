"""What the gateway adds on top of an upstream that answers immediately.

Three processes on this machine: a raw-asyncio OpenAI-style upstream that answers every
request at once with the same completion, the gateway (``sluicegate gateway``: key check,
Redis admission, usage accounting and the usage flusher all on, against the real PostgreSQL
and Redis), and this load generator (a minimal keep-alive HTTP/1.1 client, so the client's
own cost stays small and equal for both paths).

1. Latency: the same request sent directly to the upstream and through the gateway, one at a
   time, interleaved in rounds (the order flips every round). Added latency = gateway minus
   direct, at the median and at p99.
2. Throughput: 64 concurrent clients, each on its own keep-alive connection, for a few
   seconds: requests/s through the gateway (and directly, for scale) with zero errors.

Last line: JSON with ``median_added_ms``, ``p99_added_ms``, ``rps``, ``errors`` (and more).
Targets on a 2-core machine: median added <= 1.5 ms, >= 1,000 requests/s.

``--peers`` also runs LiteLLM's proxy and Portkey's gateway (see gateway_peers.py) on the same
upstream in the same run and reports each one's added latency and req/s beside ours under
``peers`` (the target: at least 2x Portkey's req/s at no more than half its added latency).
All three run at once and take turns at the sequential rounds in blocks of 100 (each block
interleaving one gateway with the direct path), so that a drift in this machine's speed (tens
of percent within minutes) touches them alike; the load runs then go one gateway at a time.
(Measured one after the other instead, our added latency over Portkey's swung from 0.33x to
0.64x between runs on one machine; in blocks, seven runs gave 0.57-0.67x.)

Environment: ``SLUICEGATE_DATABASE_URL`` (a database the bench may create databases on;
default the local ``test`` database) and ``SLUICEGATE_REDIS_URL``.
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
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import gateway_peers
import httpx
import yaml

from gateway.db.scratch import scratch_database

MODEL = "bench"
LATENCY_BLOCK_ROUNDS = 100
"""Sequential rounds a gateway runs before the next one takes its turn."""
REQUEST_BODY = json.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 16}
).encode()
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


def _use_uvloop() -> None:
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# ---- the upstream ----------------------------------------------------------------------------


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
            length = _content_length(self._buffer[:end])
            total = end + 4 + length
            if len(self._buffer) < total:
                return
            self._buffer = self._buffer[total:]
            assert self._transport is not None
            self._transport.write(UPSTREAM_RESPONSE)


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def serve_upstream(port: int) -> None:
    _use_uvloop()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(_UpstreamProtocol, "127.0.0.1", port, backlog=1024)
        async with server:
            await server.serve_forever()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())


# ---- the load generator ----------------------------------------------------------------------


class Connection:
    """One keep-alive HTTP/1.1 connection that sends prebuilt requests."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> Connection:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.transport.get_extra_info("socket").setsockopt(
            socket.IPPROTO_TCP, socket.TCP_NODELAY, 1
        )
        return cls(reader, writer)

    async def send(self, raw: bytes) -> tuple[int, bytes]:
        self.writer.write(raw)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        lowered = head.lower()
        if b"transfer-encoding: chunked" in lowered:
            body = b""
            while True:
                size = int((await self.reader.readuntil(b"\r\n"))[:-2], 16)
                chunk = await self.reader.readexactly(size + 2)
                if size == 0:
                    return status, body
                body += chunk[:-2]
        return status, await self.reader.readexactly(_content_length(head))

    def close(self) -> None:
        self.writer.close()


def build_request(port: int, path: str, api_key: str | None) -> bytes:
    auth = f"authorization: Bearer {api_key}\r\n" if api_key else ""
    return (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n{auth}"
        f"content-type: application/json\r\ncontent-length: {len(REQUEST_BODY)}\r\n\r\n"
    ).encode() + REQUEST_BODY


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its children (uvicorn workers), from /proc."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    pids = [pid]
    with contextlib.suppress(OSError):
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        pids += [int(c) for c in children]
    for p in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
    return total


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def latency_rounds(
    direct: tuple[int, bytes], gateway: tuple[int, bytes], rounds: int
) -> tuple[list[float], list[float], int]:
    """Sequential requests, one at a time, to the upstream directly and through the gateway,
    interleaved in rounds (the order flips every round): (direct ms, gateway ms, errors)."""
    direct_conn = await Connection.open(direct[0])
    gateway_conn = await Connection.open(gateway[0])
    direct_ms: list[float] = []
    gateway_ms: list[float] = []
    errors = 0

    async def timed(conn: Connection, raw: bytes, into: list[float]) -> None:
        nonlocal errors
        started = time.perf_counter()
        status, _ = await conn.send(raw)
        into.append((time.perf_counter() - started) * 1000)
        errors += status != 200

    for i in range(rounds):
        if i % 2:
            await timed(gateway_conn, gateway[1], gateway_ms)
            await timed(direct_conn, direct[1], direct_ms)
        else:
            await timed(direct_conn, direct[1], direct_ms)
            await timed(gateway_conn, gateway[1], gateway_ms)
    direct_conn.close()
    gateway_conn.close()
    return direct_ms, gateway_ms, errors


async def latency_blocks(
    direct: tuple[int, bytes], gateways: dict[str, tuple[int, bytes]], rounds: int
) -> dict[str, tuple[list[float], list[float], int]]:
    """``latency_rounds`` for every gateway, ``rounds`` each, in blocks taken in turn, so that
    a drift in this machine's speed (tens of percent within minutes) touches all alike. Each
    gateway is alone in its block: a gateway's work after its answers (settling, logging)
    falls on its own block, as it would on a machine of its own, not on another's requests."""
    timed: dict[str, tuple[list[float], list[float], int]] = {
        name: ([], [], 0) for name in gateways
    }
    blocks = max(1, rounds // LATENCY_BLOCK_ROUNDS)
    for block in range(blocks):
        size = rounds // blocks + (block < rounds % blocks)
        for name, gateway in gateways.items():
            direct_ms, gateway_ms, errors = await latency_rounds(direct, gateway, size)
            so_far = timed[name]
            timed[name] = (so_far[0] + direct_ms, so_far[1] + gateway_ms, so_far[2] + errors)
    return timed


async def throughput(port: int, raw: bytes, clients: int, seconds: float) -> tuple[float, int, int]:
    """Returns (requests/s, errors, requests)."""
    connections = [await Connection.open(port) for _ in range(clients)]
    done = 0
    errors = 0
    stop_at = 0.0

    async def client(conn: Connection) -> None:
        nonlocal done, errors
        while time.perf_counter() < stop_at:
            status, _ = await conn.send(raw)
            done += 1
            errors += status != 200

    started = time.perf_counter()
    stop_at = started + seconds
    await asyncio.gather(*(client(c) for c in connections))
    elapsed = time.perf_counter() - started
    for conn in connections:
        conn.close()
    return done / elapsed, errors, done


# ---- the gateway and its database ------------------------------------------------------------


async def _create_key(database_url: str) -> str:
    from gateway.auth import generate_key
    from gateway.db import keys
    from gateway.db.session import create_engine, create_sessionmaker

    engine = create_engine(database_url)
    plaintext, digest, prefix = generate_key()
    async with create_sessionmaker(engine)() as session:
        await keys.create_key(
            session,
            name="bench",
            key_hash=digest,
            key_prefix=prefix,
            rpm_limit=10**9,
            tpm_limit=2_000_000_000,
            max_parallel_requests=10_000,
            token_budget=10**15,
            budget_period="month",
        )
        await session.commit()
    await engine.dispose()
    return plaintext


@contextlib.contextmanager
def process(args: list[str], env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen(args, env=env, start_new_session=True)
    try:
        yield proc
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1).status_code < 500:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2000, help="sequential rounds")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=5.0, help="per throughput run")
    parser.add_argument("--workers", type=int, default=1, help="gateway processes")
    parser.add_argument("--peers", action="store_true", help="also run LiteLLM and Portkey")
    parser.add_argument("--litellm", default="/work/venvs/litellm/bin/litellm")
    parser.add_argument(
        "--portkey",
        default="/work/venvs/portkey/node_modules/@portkey-ai/gateway/build/start-server.js",
    )
    parser.add_argument("--serve-upstream", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_upstream:
        serve_upstream(args.serve_upstream)
        return 0
    _use_uvloop()

    admin_url = os.environ.get(
        "SLUICEGATE_DATABASE_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
    )
    redis_url = os.environ.get("SLUICEGATE_REDIS_URL", "redis://127.0.0.1:6379/0")
    upstream_port, gateway_port = free_port(), free_port()
    tmp = Path(tempfile.mkdtemp(prefix="sg-bench-"))
    config = tmp / "models.yaml"
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
    usage_stream = f"sg:usage:bench:{uuid.uuid4().hex[:8]}"
    with scratch_database(admin_url, prefix="sg_bench") as database_url:
        api_key = asyncio.run(_create_key(database_url))
        env = {
            **os.environ,
            "SLUICEGATE_DATABASE_URL": database_url,
            "SLUICEGATE_REDIS_URL": redis_url,
            "SLUICEGATE_CONFIG": str(config),
            "SLUICEGATE_USAGE_STREAM": usage_stream,
            "SLUICEGATE_MASTER_KEY": "bench-master",
        }
        upstream_cmd = [sys.executable, __file__, "--serve-upstream", str(upstream_port)]
        gateway_cmd = [sys.executable, "-m", "gateway.cli", "gateway", "--host", "127.0.0.1"]
        gateway_cmd += ["--port", str(gateway_port), "--log-level", "warning"]
        gateway_cmd += ["--workers", str(args.workers)]
        with (
            process(upstream_cmd) as upstream,
            process(gateway_cmd, env) as gateway,
            contextlib.ExitStack() as peers,
        ):
            wait_ready(f"http://127.0.0.1:{gateway_port}/health/live", gateway)
            for _ in range(100):
                with contextlib.suppress(OSError):
                    socket.create_connection(("127.0.0.1", upstream_port), 1).close()
                    break
                time.sleep(0.05)
            if upstream.poll() is not None:
                raise RuntimeError("upstream exited")
            gateway_request = build_request(gateway_port, "/v1/chat/completions", api_key)
            gateways = {"sluicegate": (gateway_port, gateway_request, gateway.pid)}
            if args.peers:
                gateways |= start_peers(args, upstream_port, peers)
            results = asyncio.run(measure(args, upstream_port, gateways))
            result = results.pop("sluicegate")
            result["usage_records"] = asyncio.run(
                _count_usage(database_url, redis_url, usage_stream, result["gateway_requests"])
            )
            if args.peers:
                result["peers"] = {
                    name: {k: peer[k] for k in PEER_FIELDS} for name, peer in results.items()
                }
                result |= gateway_peers.verdict(result, result["peers"].get("portkey"))
    print(json.dumps(result))
    return 0


async def _count_usage(database_url: str, redis_url: str, stream: str, expected: int) -> int:
    """Usage rows in PostgreSQL once the flusher caught up (up to 30 s): one per request."""
    from redis.asyncio import Redis
    from sqlalchemy import text

    from gateway.db.session import create_engine

    engine = create_engine(database_url)
    deadline = time.monotonic() + 30
    while True:
        async with engine.connect() as conn:
            rows = (await conn.execute(text("SELECT count(*) FROM usage_records"))).scalar_one()
        if rows >= expected or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    await engine.dispose()
    redis = Redis.from_url(redis_url)
    await redis.delete(stream)
    await redis.aclose()
    return int(rows)


PEER_FIELDS = ("median_added_ms", "p99_added_ms", "rps", "errors", "gateway_cpu_ms_per_request")


def start_peers(
    args: argparse.Namespace, upstream_port: int, stack: contextlib.ExitStack
) -> dict[str, tuple[int, bytes, int]]:
    """LiteLLM's and Portkey's gateways on the same upstream, running until ``stack`` closes:
    name -> (port, the request to send it, its process id)."""
    peers = {}
    starters = {"litellm": (gateway_peers.litellm, args.litellm)}
    starters["portkey"] = (gateway_peers.portkey, args.portkey)
    for name, (starter, path) in starters.items():
        port = free_port()
        proc, raw, ready = stack.enter_context(
            starter(path, port, upstream_port, MODEL, REQUEST_BODY, process)
        )
        wait_ready(ready, proc, timeout_s=180)
        peers[name] = (port, raw, proc.pid)
    return peers


async def measure(
    args: argparse.Namespace, upstream_port: int, gateways: dict[str, tuple[int, bytes, int]]
) -> dict[str, dict[str, float | int]]:
    """Every gateway's added latency (timed in the same rounds) and then, one gateway at a
    time, its requests/s under load and the CPU it spent on them."""
    direct = (upstream_port, build_request(upstream_port, "/v1/chat/completions", None))
    targets = {name: (port, raw) for name, (port, raw, _) in gateways.items()}
    # Warm up: the key cache, connection pools, scripts.
    for target in targets.values():
        await latency_rounds(direct, target, 200)
    warm = {}
    for name, (port, raw) in targets.items():
        warm[name] = (await throughput(port, raw, args.clients, 1.0))[2]

    latencies = await latency_blocks(direct, targets, args.rounds)
    direct_rps, direct_errors, _ = await throughput(
        upstream_port, direct[1], args.clients, args.seconds
    )
    results: dict[str, dict[str, float | int]] = {}
    for name, (port, raw, pid) in gateways.items():
        direct_ms, gateway_ms, seq_errors = latencies[name]
        median_direct, p99_direct = statistics.median(direct_ms), percentile(direct_ms, 0.99)
        paired = sorted(g - d for g, d in zip(gateway_ms, direct_ms, strict=True))
        median_gateway, p99_gateway = statistics.median(gateway_ms), percentile(gateway_ms, 0.99)
        print(
            f"{name}: sequential, {args.rounds} rounds: direct median {median_direct:.3f} ms "
            f"p99 {p99_direct:.3f} ms | gateway median {median_gateway:.3f} ms "
            f"p99 {p99_gateway:.3f} ms | added median {median_gateway - median_direct:.3f} ms "
            f"(paired {statistics.median(paired):.3f} ms) p99 {p99_gateway - p99_direct:.3f} ms"
        )
        cpu_before = cpu_seconds(pid)
        gateway_rps, gateway_errors, loaded = await throughput(
            port, raw, args.clients, args.seconds
        )
        cpu_ms_per_request = (cpu_seconds(pid) - cpu_before) * 1000 / (gateway_rps * args.seconds)
        print(
            f"{name}: {args.clients} concurrent clients, {args.seconds:.0f} s each: direct "
            f"{direct_rps:,.0f} req/s, gateway {gateway_rps:,.0f} req/s "
            f"({gateway_rps / direct_rps:.2f}x), gateway errors {gateway_errors}; "
            f"gateway CPU {cpu_ms_per_request:.3f} ms/request"
        )
        results[name] = {
            "median_added_ms": round(median_gateway - median_direct, 3),
            "p99_added_ms": round(p99_gateway - p99_direct, 3),
            "paired_median_added_ms": round(statistics.median(paired), 3),
            "median_direct_ms": round(median_direct, 3),
            "median_gateway_ms": round(median_gateway, 3),
            "rps": round(gateway_rps, 1),
            "direct_rps": round(direct_rps, 1),
            "errors": seq_errors + gateway_errors + direct_errors,
            "gateway_cpu_ms_per_request": round(cpu_ms_per_request, 3),
            "gateway_requests": 200 + warm[name] + args.rounds + loaded,
            "clients": args.clients,
            "gateway_workers": args.workers if name == "sluicegate" else 1,
        }
    return results


if __name__ == "__main__":
    sys.exit(main())

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

``--baseline DIR`` runs the gateway of another checkout of this repository (e.g. ``git worktree
add /tmp/before <commit>``) the same way, in the same blocks and load runs, and reports it under
``baseline`` with ``vs_baseline`` (ours over it: added latency and req/s): a before/after that
this machine's drift cannot tilt. Its database is migrated by this checkout's migrations, so
the two must agree on the schema.

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
from instant_upstream import MODEL, use_uvloop
from load_client import latency_blocks, latency_rounds, percentile, throughput

from sluicegate.gateway.db.scratch import scratch_database

UPSTREAM_SCRIPT = Path(__file__).with_name("instant_upstream.py")

REQUEST_BODY = json.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "Say hello"}], "max_tokens": 16}
).encode()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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


# ---- the gateway and its database ------------------------------------------------------------


def wait_listening(port: int) -> None:
    """Until something accepts connections on ``port`` (at most ~5 s)."""
    for _ in range(100):
        with contextlib.suppress(OSError):
            socket.create_connection(("127.0.0.1", port), 1).close()
            return
        time.sleep(0.05)


def gateway_command(port: int, workers: int) -> list[str]:
    """``sluicegate gateway`` of whichever checkout the process starts in."""
    return [sys.executable, "-m", "sluicegate.gateway.cli", "gateway", "--host", "127.0.0.1", "--port",
            str(port), "--log-level", "warning", "--workers", str(workers)]  # fmt: skip


async def _create_key(database_url: str) -> str:
    from sluicegate.gateway.db import keys
    from sluicegate.gateway.db.session import create_engine, create_sessionmaker
    from sluicegate.gateway.keys.records import generate_key

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
def process(
    args: list[str], env: dict[str, str] | None = None, cwd: Path | None = None
) -> Iterator[subprocess.Popen]:
    proc = subprocess.Popen(args, env=env, cwd=cwd, start_new_session=True)
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
    parser.add_argument(
        "--baseline",
        type=Path,
        help="another checkout of this repository whose gateway runs beside ours (before/after)",
    )
    args = parser.parse_args()
    use_uvloop()

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
        upstream_cmd = [sys.executable, str(UPSTREAM_SCRIPT), str(upstream_port)]
        with (
            process(upstream_cmd) as upstream,
            process(gateway_command(gateway_port, args.workers), env) as gateway,
            contextlib.ExitStack() as peers,
        ):
            wait_ready(f"http://127.0.0.1:{gateway_port}/health/live", gateway)
            wait_listening(upstream_port)
            if upstream.poll() is not None:
                raise RuntimeError("upstream exited")
            gateway_request = build_request(gateway_port, "/v1/chat/completions", api_key)
            gateways = {"sluicegate": (gateway_port, gateway_request, gateway.pid)}
            if args.baseline:
                gateways["baseline"], baseline_db = start_baseline(args, admin_url, env, peers)
            if args.peers:
                gateways |= start_peers(args, upstream_port, peers)
            results = asyncio.run(measure(args, upstream_port, gateways))
            result = results.pop("sluicegate")
            result["usage_records"] = asyncio.run(
                _count_usage(database_url, result["gateway_requests"])
            )
            if args.baseline:
                baseline = results.pop("baseline")
                result["baseline"] = {k: baseline[k] for k in PEER_FIELDS}
                result["baseline"]["usage_records"] = asyncio.run(
                    _count_usage(baseline_db, baseline["gateway_requests"])
                )
                result["vs_baseline"] = {
                    "added_latency": round(
                        result["median_added_ms"] / baseline["median_added_ms"], 2
                    ),
                    "rps": round(result["rps"] / baseline["rps"], 2),
                }
            if args.peers:
                result["peers"] = {
                    name: {k: peer[k] for k in PEER_FIELDS} for name, peer in results.items()
                }
                result |= gateway_peers.verdict(result, result["peers"].get("portkey"))
        asyncio.run(_delete_streams(redis_url, usage_stream + "*"))
    print(json.dumps(result))
    return 0


async def _count_usage(database_url: str, expected: int) -> int:
    """Usage rows in PostgreSQL once the flusher caught up (up to 30 s): one per request."""
    from sqlalchemy import text

    from sluicegate.gateway.db.session import create_engine

    engine = create_engine(database_url)
    deadline = time.monotonic() + 30
    while True:
        async with engine.connect() as conn:
            rows = (await conn.execute(text("SELECT count(*) FROM usage_records"))).scalar_one()
        if rows >= expected or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    await engine.dispose()
    return int(rows)


async def _delete_streams(redis_url: str, pattern: str) -> None:
    """The usage streams of the gateways this run started (once they have stopped)."""
    from redis.asyncio import Redis

    redis = Redis.from_url(redis_url)
    streams = [name async for name in redis.scan_iter(match=pattern)]
    if streams:
        await redis.delete(*streams)
    await redis.aclose()


PEER_FIELDS = ("median_added_ms", "p99_added_ms", "rps", "errors", "gateway_cpu_ms_per_request")


def start_baseline(
    args: argparse.Namespace, admin_url: str, env: dict[str, str], stack: contextlib.ExitStack
) -> tuple[tuple[int, bytes, int], str]:
    """The gateway of the ``--baseline`` checkout, on a database and a usage stream of its own,
    running until ``stack`` closes: ((port, the request to send it, its process id), its
    database's URL)."""
    database_url = stack.enter_context(scratch_database(admin_url, prefix="sg_bench"))
    api_key = asyncio.run(_create_key(database_url))
    stream = env["SLUICEGATE_USAGE_STREAM"] + ":baseline"
    port = free_port()
    baseline_env = env | {
        "SLUICEGATE_DATABASE_URL": database_url,
        "SLUICEGATE_USAGE_STREAM": stream,
        "PYTHONPATH": str(args.baseline.resolve()),
    }
    command = gateway_command(port, args.workers)
    proc = stack.enter_context(process(command, baseline_env, cwd=args.baseline))
    wait_ready(f"http://127.0.0.1:{port}/health/live", proc)
    request = build_request(port, "/v1/chat/completions", api_key)
    return (port, request, proc.pid), database_url


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

"""What the transport costs: streams through gateway + Redis + one worker vs in-process.

The same seeded workload (N requests, C concurrent, greedy, ignore_eos) runs three ways,
alternating in rounds within one run:

- gateway: C concurrent streaming HTTP clients -> the gateway (auth, rate limits, usage
  accounting on) -> Redis Streams -> one engine worker process -> back the same way;
- in-process: the same requests straight into an ``AsyncEngine`` in this process;
- transport: ``EngineProvider`` in this process -> Redis Streams -> the same worker, no HTTP,
  which tells the Redis Streams transport's own cost from the HTTP layer's.

Both use a random Llama of small realistic shape (4 layers, hidden 512) so that, as with a real
model, the engine's step dominates. On a GPU the model's maths leaves the CPU cores to the
transport; on a small CPU machine it would take them all, so by default the model gets one
thread in both modes (``--engine-threads``), leaving a core to the HTTP client, the gateway and
Redis, and the ratio measures the transport rather than two processes fighting for one core. Prints TTFT p50/p99 and output tokens/s for each and their
ratio; the last line is one JSON object with ttft_p50_ms, ttft_p99_ms, gateway_tok_s,
inprocess_tok_s, ratio (gateway / in-process, target >= 0.9 at 32 concurrent streams), and
transport_tok_s, transport_ratio, worker_cpu_ms_per_token and core_cpu_ms_per_token (the
worker process's CPU per token served, and its engine core process's; ``--worker-arg`` passes
flags to the worker, e.g. ``--no-core-process``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# This script's folder would shadow the `kernels` package with bench/kernels.py.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]

import httpx  # noqa: E402

from sluicegate.engine.demo_model import create_demo_model  # noqa: E402
from sluicegate.gateway.children import Stack, free_port  # noqa: E402
from sluicegate.gateway.db.scratch import scratch_database  # noqa: E402

_CONTENT = re.compile(rb'"content":"[^"]')
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":(\d+)')
ENGINE_OPTIONS: dict[str, Any] = {"device": "cpu", "dtype": "float32", "num_kv_blocks": 1024}


@dataclass
class Result:
    ttft_s: list[float]
    tokens: int
    wall_s: float

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def workload(n: int) -> list[str]:
    topics = ["a river", "a gate", "the sea", "a city", "the wind", "a fox", "a bridge", "rain"]
    return [
        f"Request {i}: tell me about {topics[i % len(topics)]} and day {i * 7 % 31}."
        for i in range(n)
    ]


# ---- in-process ----------------------------------------------------------------------------------


async def run_inprocess(
    engine: Any, prompts: list[str], concurrency: int, max_tokens: int
) -> Result:
    from sluicegate.engine import SamplingParams

    limit = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []
    tokens = 0

    async def one(prompt: str) -> None:
        nonlocal tokens
        async with limit:
            began = time.perf_counter()
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            first = True
            outputs = engine.add_request(
                uuid.uuid4().hex, messages=[{"role": "user", "content": prompt}], params=params
            )
            if asyncio.iscoroutine(outputs):
                outputs = await outputs
            async for output in outputs:
                if output.token_ids:
                    if first:
                        ttfts.append(time.perf_counter() - began)
                        first = False
                    tokens += len(output.token_ids)

    began = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    return Result(ttfts, tokens, time.perf_counter() - began)


# ---- through the gateway -------------------------------------------------------------------------


async def _stream_once(port: int, api_key: str, body: bytes) -> tuple[float | None, bytes]:
    """One streaming request over a bare HTTP/1.1 connection: the client costs next to no CPU
    (no SSE or JSON parsing per event), like the in-process consumer it is compared with.
    Returns the time to the first content byte and the raw response."""
    began = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Authorization: Bearer {api_key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    writer.write(head.encode() + body)
    ttft = None
    received = bytearray()
    try:
        while piece := await reader.read(65536):
            if ttft is None and _CONTENT.search(piece):
                ttft = time.perf_counter() - began
            received += piece
    finally:
        writer.close()
    return ttft, bytes(received)


async def run_gateway(
    port: int, api_key: str, model: str, prompts: list[str], concurrency: int, max_tokens: int
) -> Result:
    limit = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []
    tokens = 0

    async def one(prompt: str) -> None:
        nonlocal tokens
        body = {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with limit:
            ttft, raw = await _stream_once(port, api_key, json.dumps(body).encode())
        if not raw.startswith(b"HTTP/1.1 200") or b'data: {"error"' in raw:
            raise RuntimeError(f"request failed: {raw[:300]!r} ... {raw[-300:]!r}")
        if ttft is not None:
            ttfts.append(ttft)
        tokens += int(_COMPLETION_TOKENS.findall(raw)[-1])

    began = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    return Result(ttfts, tokens, time.perf_counter() - began)


async def run_transport(
    redis_url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int
) -> Result:
    """The same requests through ``EngineProvider`` directly: Redis Streams and the worker,
    without HTTP, so the report can tell the transport's cost from the HTTP layer's."""
    import redis.asyncio as aioredis

    from sluicegate.gateway.canonical import ChatRequest, Sampling, text_message
    from sluicegate.gateway.providers.engine.provider import EngineProvider
    from sluicegate.gateway.settings import Settings

    client = aioredis.from_url(redis_url)
    provider = EngineProvider(client, Settings(redis_url=redis_url), model)
    limit = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []
    tokens = 0

    async def one(prompt: str) -> None:
        nonlocal tokens
        request = ChatRequest(
            request_id=uuid.uuid4().hex,
            model=model,
            sampling=Sampling(max_tokens=max_tokens, temperature=0, ignore_eos=True),
            messages=[text_message("user", prompt)],
        )
        async with limit:
            began = time.perf_counter()
            async for chunk in provider.generate(request):
                if began:
                    ttfts.append(time.perf_counter() - began)
                    began = 0.0
                if chunk.usage is not None:
                    tokens += chunk.usage.completion_tokens

    try:
        began = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        return Result(ttfts, tokens, time.perf_counter() - began)
    finally:
        await provider.close()
        await client.aclose()


# ---- services ------------------------------------------------------------------------------------


def wait_ok(url: str, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{what} not ready")


def wait_listed(base_url: str, api_key: str, model: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        response = httpx.get(
            f"{base_url}/v1/models", headers={"Authorization": f"Bearer {api_key}"}, timeout=5
        )
        if any(m["id"] == model for m in response.json().get("data", [])):
            return
        time.sleep(0.2)
    raise RuntimeError(f"{model} never appeared in /v1/models")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument(
        "--engine-threads",
        type=int,
        default=1,
        help="CPU threads for the model in both modes (default 1: see the module docstring)",
    )
    parser.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        help="extra flag for the engine worker, e.g. --worker-arg=--no-core-process",
    )
    parser.add_argument(
        "--database-url",
        default=os.environ.get(
            "SLUICEGATE_TEST_DATABASE_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
        ),
        help="a database with rights to create the bench's own database",
    )
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("SLUICEGATE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"),
    )
    args = parser.parse_args(argv)
    if args.engine_threads:
        ENGINE_OPTIONS["num_threads"] = args.engine_threads
    prompts = workload(args.requests)
    model_name = f"bench-e2e-{uuid.uuid4().hex[:6]}"
    master_key = "sk-admin-bench-" + uuid.uuid4().hex

    with (
        tempfile.TemporaryDirectory() as tmp,
        scratch_database(args.database_url, prefix="sg_bench") as database_url,
    ):
        model_dir = create_demo_model(
            Path(tmp) / "model",
            hidden_size=512,
            intermediate_size=1408,
            num_layers=args.layers,
            num_heads=8,
            num_kv_heads=8,
        )
        stack = Stack()
        try:
            env = dict(os.environ)
            env.update(
                SLUICEGATE_DATABASE_URL=database_url,
                SLUICEGATE_REDIS_URL=args.redis_url,
                SLUICEGATE_MASTER_KEY=master_key,
                SLUICEGATE_CONFIG="",
            )
            port, metrics_port = free_port(), free_port()
            engine_flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_OPTIONS.items()]
            worker = stack.spawn(
                "engine",
                [sys.executable, "-m", "sluicegate.engine.worker", "--model", str(model_dir),
                 "--served-model-name", model_name, "--redis-url", args.redis_url,
                 "--metrics-port", str(metrics_port), "--max-pull", "64", *engine_flags,
                 *args.worker_arg],
                env,
                Path(tmp) / "logs",
            )  # fmt: skip
            stack.spawn(
                "gateway",
                [sys.executable, "-m", "sluicegate.gateway.cli", "gateway", "--port", str(port),
                 "--log-level", "warning"],
                env,
                Path(tmp) / "logs",
            )  # fmt: skip
            base_url = f"http://127.0.0.1:{port}"
            wait_ok(f"{base_url}/health/ready", "gateway")
            wait_ok(f"http://127.0.0.1:{metrics_port}/health/ready", "engine worker")
            response = httpx.post(
                f"{base_url}/admin/keys",
                headers={"Authorization": f"Bearer {master_key}"},
                json={"name": "bench"},
            )
            response.raise_for_status()
            api_key = response.json()["key"]
            wait_listed(base_url, api_key, model_name)
            results, cpu = asyncio.run(
                _rounds(args, prompts, model_dir, port, api_key, model_name, worker.process.pid)
            )
        finally:
            stack.stop()

    # Rounds pair a gateway run with an in-process run next to it in time; the median of the
    # per-round ratios is robust to whatever else this machine is doing meanwhile.
    ratio = statistics.median(
        g.tok_s / p.tok_s for g, p in zip(results["gateway"], results["inprocess"], strict=True)
    )
    transport_ratio = statistics.median(
        t.tok_s / p.tok_s for t, p in zip(results["transport"], results["inprocess"], strict=True)
    )
    transport_tok_s = statistics.median(r.tok_s for r in results["transport"])
    gateway_tok_s = statistics.median(r.tok_s for r in results["gateway"])
    inprocess_tok_s = statistics.median(r.tok_s for r in results["inprocess"])
    ttfts = [t for r in results["gateway"] for t in r.ttft_s]
    inproc_ttfts = [t for r in results["inprocess"] for t in r.ttft_s]
    print(
        f"\n{args.requests} requests, {args.concurrency} concurrent, {args.max_tokens} tokens each"
    )
    print(f"{'':12} {'tok/s':>10} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12}")
    for label, tok_s, t in (
        ("gateway", gateway_tok_s, ttfts),
        ("in-process", inprocess_tok_s, inproc_ttfts),
    ):
        print(
            f"{label:12} {tok_s:10.1f} {percentile(t, 0.5) * 1000:12.1f} "
            f"{percentile(t, 0.99) * 1000:12.1f}"
        )
    print(f"ratio gateway / in-process (median of rounds): {ratio:.3f} (target >= 0.90)")
    print(
        f"Redis Streams transport alone (EngineProvider -> worker, no HTTP): {transport_tok_s:.1f} "
        f"tok/s, ratio {transport_ratio:.3f}"
    )
    print(
        json.dumps(
            {
                "ttft_p50_ms": round(percentile(ttfts, 0.5) * 1000, 2),
                "ttft_p99_ms": round(percentile(ttfts, 0.99) * 1000, 2),
                "inprocess_ttft_p50_ms": round(percentile(inproc_ttfts, 0.5) * 1000, 2),
                "gateway_tok_s": round(gateway_tok_s, 1),
                "inprocess_tok_s": round(inprocess_tok_s, 1),
                "ratio": round(ratio, 4),
                "transport_tok_s": round(transport_tok_s, 1),
                "transport_ratio": round(transport_ratio, 4),
                "concurrency": args.concurrency,
                "requests": args.requests,
                "max_tokens": args.max_tokens,
                "engine_threads": args.engine_threads,
                # CPU the worker process and its engine core process (if separate) spent per
                # token served through it: the step loop's process bounds the throughput.
                "worker_cpu_ms_per_token": round(cpu["worker"] / cpu["tokens"] * 1000, 4),
                "core_cpu_ms_per_token": round(cpu["core"] / cpu["tokens"] * 1000, 4),
            }
        )
    )
    return 0


async def _rounds(
    args: argparse.Namespace,
    prompts: list[str],
    model_dir: Path,
    port: int,
    api_key: str,
    model_name: str,
    worker_pid: int,
) -> tuple[dict[str, list[Result]], dict[str, float]]:
    from sluicegate.engine import AsyncEngine

    engine = AsyncEngine(str(model_dir), **ENGINE_OPTIONS)
    started = engine.start()
    if asyncio.iscoroutine(started):
        await started
    results: dict[str, list[Result]] = {"gateway": [], "inprocess": [], "transport": []}
    try:
        warm = prompts[: args.concurrency]
        await run_inprocess(engine, warm, args.concurrency, 4)
        await run_gateway(port, api_key, model_name, warm, args.concurrency, 4)
        await run_transport(args.redis_url, model_name, warm, args.concurrency, 4)
        runs = {
            "inprocess": lambda: run_inprocess(engine, prompts, args.concurrency, args.max_tokens),
            "gateway": lambda: run_gateway(
                port, api_key, model_name, prompts, args.concurrency, args.max_tokens
            ),
            "transport": lambda: run_transport(
                args.redis_url, model_name, prompts, args.concurrency, args.max_tokens
            ),
        }
        order = list(runs)
        cpu = {"worker": 0.0, "core": 0.0, "tokens": 0.0}
        for round_no in range(args.rounds):
            # Rotate which goes first, so none always runs on a warmer (or busier) machine.
            for mode in order[round_no % 3 :] + order[: round_no % 3]:
                before = _worker_cpu_s(worker_pid)
                results[mode].append(await runs[mode]())
                if mode != "inprocess":
                    after = _worker_cpu_s(worker_pid)
                    cpu["worker"] += after[0] - before[0]
                    cpu["core"] += after[1] - before[1]
                    cpu["tokens"] += results[mode][-1].tokens
            print(
                f"round {round_no + 1}: "
                + ", ".join(f"{m} {results[m][-1].tok_s:.1f} tok/s" for m in order),
                flush=True,
            )
    finally:
        stopped = engine.shutdown()
        if asyncio.iscoroutine(stopped):
            await stopped
    return results, cpu


def _worker_cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds of the worker process, and of its children (the engine core process)."""

    def cpu_s(p: int | str) -> float:
        fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return cpu_s(pid), sum(cpu_s(c) for c in children)


if __name__ == "__main__":
    raise SystemExit(main())

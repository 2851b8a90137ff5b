"""Prefix-cache hit rate across two workers, with and without prefix-aware routing.

A shared-prefix workload: P long system prompts (think: P customers' assistants), each used by
R requests in a shuffled order, a few at a time. Each of two workers has room in its KV cache
for only about half of the prefixes, as when a deployment serves more prompts than one GPU holds.
Without affinity, requests spread by capacity alone, so both workers cycle through every prefix
and evict each other's; with it, the gateway sends a request to the worker that served its
prefix last (unless that worker is much busier), so each worker keeps its half cached.

Hit rate = prefix-cache hits / queries as the workers count them (their Prometheus counters),
summed over both workers; fresh workers for each mode. The last line is one JSON object with
hit_rate_with_affinity, hit_rate_without_affinity.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import sys
import tempfile
import time
import uuid
from pathlib import Path

# This script's folder would shadow the `kernels` package with bench/kernels.py.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]

import httpx  # noqa: E402

from sluicegate.engine.demo_model import create_demo_model  # noqa: E402
from sluicegate.gateway.canonical import ChatRequest, Sampling, text_message  # noqa: E402
from sluicegate.gateway.providers.engine.provider import EngineProvider  # noqa: E402
from sluicegate.gateway.settings import Settings  # noqa: E402
from sluicegate.gateway.up import Stack, free_port  # noqa: E402

_COUNTER = re.compile(r"^(sluicegate:prefix_cache_(?:hits|queries)_total)\{[^}]*\} (\S+)$", re.M)
_WORDS = "river gate water stone bridge lantern harbor meadow signal engine token block".split()


def system_prompts(count: int, chars: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        words = [f"Assistant {i} rules:"]
        while sum(len(w) + 1 for w in words) < chars:
            words.append(rng.choice(_WORDS))
        prompts.append(" ".join(words))
    return prompts


def counters(port: int) -> tuple[float, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    values = dict(_COUNTER.findall(text))
    return (
        float(values.get("sluicegate:prefix_cache_hits_total", 0)),
        float(values.get("sluicegate:prefix_cache_queries_total", 0)),
    )


def wait_ready(port: int, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/health/ready", timeout=1).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError("worker not ready")


async def drive(
    provider: EngineProvider, model: str, jobs: list[tuple[str, str]], concurrency: int
) -> None:
    limit = asyncio.Semaphore(concurrency)

    async def one(system: str, question: str) -> None:
        request = ChatRequest(
            request_id=uuid.uuid4().hex,
            model=model,
            sampling=Sampling(max_tokens=4, temperature=0, ignore_eos=True),
            messages=[text_message("system", system), text_message("user", question)],
        )
        async with limit:
            async for _ in provider.generate(request):
                pass

    await asyncio.gather(*(one(s, q) for s, q in jobs))


async def run_mode(
    affinity: bool, redis_url: str, model: str, ports: list[int], jobs: list[tuple[str, str]],
    concurrency: int,
) -> float:  # fmt: skip
    import redis.asyncio as aioredis

    redis = aioredis.from_url(redis_url)
    provider = EngineProvider(redis, Settings(redis_url=redis_url), model, prefix_affinity=affinity)
    try:
        for _ in range(150):  # both workers announced themselves (30 s at most)
            if len(await provider.live_workers()) >= 2:
                break
            await asyncio.sleep(0.2)
        before = [counters(p) for p in ports]
        await drive(provider, model, jobs, concurrency)
        after = [counters(p) for p in ports]
    finally:
        await provider.close()
        await redis.aclose()
    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    return hits / queries if queries else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefixes", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--prefix-chars", type=int, default=1200)
    parser.add_argument("--kv-blocks", type=int, default=320, help="per worker")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("SLUICEGATE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"),
    )
    args = parser.parse_args(argv)
    prompts = system_prompts(args.prefixes, args.prefix_chars, seed=0)
    rng = random.Random(1)
    jobs = [(p, f"Question {r}?") for p in prompts for r in range(args.repeats)]
    rng.shuffle(jobs)

    rates: dict[bool, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = create_demo_model(Path(tmp) / "model")
        for affinity in (False, True):
            model = f"bench-prefix-{uuid.uuid4().hex[:6]}"
            stack = Stack()
            try:
                ports = [free_port(), free_port()]
                for index, port in enumerate(ports):
                    stack.spawn(
                        f"worker{index}",
                        [sys.executable, "-m", "sluicegate.engine.worker", "--model", str(model_dir),
                         "--served-model-name", model, "--redis-url", args.redis_url,
                         "--metrics-port", str(port), "--device", "cpu", "--dtype", "float32",
                         "--num-kv-blocks", str(args.kv_blocks)],
                        dict(os.environ),
                        Path(tmp) / "logs",
                    )  # fmt: skip
                for port in ports:
                    wait_ready(port)
                rates[affinity] = asyncio.run(
                    run_mode(affinity, args.redis_url, model, ports, jobs, args.concurrency)
                )
            finally:
                stack.stop()
            label = "with" if affinity else "without"
            print(f"prefix-cache hit rate {label} affinity: {rates[affinity]:.3f}", flush=True)

    print(
        f"{args.prefixes} prefixes of ~{args.prefix_chars} chars x {args.repeats} requests, "
        f"2 workers x {args.kv_blocks} KV blocks, {args.concurrency} concurrent"
    )
    print(
        json.dumps(
            {
                "hit_rate_with_affinity": round(rates[True], 4),
                "hit_rate_without_affinity": round(rates[False], 4),
                "prefixes": args.prefixes,
                "repeats": args.repeats,
                "kv_blocks_per_worker": args.kv_blocks,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

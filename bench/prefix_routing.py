"""Prefix-cache hit rate and time to first token across four workers, by routing policy.

A multi-turn chat workload: C conversations, each with a system prompt of its own (think: C
customers' assistants) and T turns; each turn sends the whole conversation so far (the
earlier answers as the model gave them) plus a new user message. Conversations run a few at
a time, their turns interleaved. Each worker's KV cache holds only part of the conversations,
so where a turn lands decides whether its history is still cached there.

Policies, each on fresh workers, in one run:
- round_robin: worker 1, 2, 3, 4, 1... regardless of content;
- text_hash: the gateway's text-chunk affinity (the worker that last served the prefix);
- kv_events: the gateway's routing by the workers' own KV events (the shipped default);
- oracle: the same score, but every worker's event stream read to its end right before each
  decision, so it routes by what each cache holds at that moment.

``to_one_worker``: the share of turns sent to one worker's own stream (the rest go to the
shared stream, which whichever worker has room reads).

Hit rate = prefix-cache hits / queries as the workers count them (their Prometheus counters),
over all four workers. TTFT: from the provider call to the first chunk, at the gateway. The
last line is one JSON object with each policy's hit rate and TTFT p50/p99, and kv_events'
hit rate as a share of the oracle's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

# This script's folder would shadow the `kernels` package with bench/kernels.py.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]

import httpx  # noqa: E402

from sluicegate.engine import protocol, redis_names  # noqa: E402
from sluicegate.engine.demo_model import create_demo_model  # noqa: E402
from sluicegate.gateway.canonical import ChatRequest, Message, Sampling, text_message  # noqa: E402
from sluicegate.gateway.children import Stack, free_port  # noqa: E402
from sluicegate.gateway.providers.engine.provider import EngineProvider  # noqa: E402
from sluicegate.gateway.settings import Settings  # noqa: E402

POLICIES = ("round_robin", "text_hash", "kv_events", "oracle")
_COUNTER = re.compile(r"^(sluicegate:prefix_cache_(?:hits|queries)_total)\{[^}]*\} (\S+)$", re.M)
_WORDS = "river gate water stone bridge lantern harbor meadow signal engine token block".split()


def words(rng: random.Random, chars: int, head: str) -> str:
    out = [head]
    while sum(len(w) + 1 for w in out) < chars:
        out.append(rng.choice(_WORDS))
    return " ".join(out)


class RoundRobin(EngineProvider):
    async def _pick_stream(
        self,
        message: protocol.Request,
        hashes: list[int],
        workers: dict[str, protocol.Heartbeat],
        adapter: str | None = None,
    ) -> str:
        self._turn = getattr(self, "_turn", -1) + 1
        names = sorted(workers)
        return redis_names.worker_stream(self.model, names[self._turn % len(names)])


class TextHash(EngineProvider):
    async def _pick_stream(
        self,
        message: protocol.Request,
        hashes: list[int],
        workers: dict[str, protocol.Heartbeat],
        adapter: str | None = None,
    ) -> str:
        return await self.workers.pick_stream(hashes, workers, adapter)


class Oracle(EngineProvider):
    async def _pick_stream(
        self,
        message: protocol.Request,
        hashes: list[int],
        workers: dict[str, protocol.Heartbeat],
        adapter: str | None = None,
    ) -> str:
        index = self.kv_routing.index
        while await index.read_synced(block_ms=None):
            pass
        return await super()._pick_stream(message, hashes, workers, adapter)


PROVIDERS = {
    "round_robin": RoundRobin,
    "text_hash": TextHash,
    "kv_events": EngineProvider,
    "oracle": Oracle,
}


def counters(port: int) -> tuple[float, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    values = dict(_COUNTER.findall(text))
    return (
        float(values.get("sluicegate:prefix_cache_hits_total", 0)),
        float(values.get("sluicegate:prefix_cache_queries_total", 0)),
    )


def wait_ready(port: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/health/ready", timeout=1).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError("worker not ready")


async def converse(
    provider: EngineProvider,
    model: str,
    conversations: list[list[str]],
    systems: list[str],
    concurrency: int,
    max_tokens: int,
) -> list[float]:
    """Every conversation, turn after turn, ``concurrency`` at a time; each turn's TTFT."""
    limit = asyncio.Semaphore(concurrency)
    ttfts: list[float] = []

    async def one(system: str, turns: list[str]) -> None:
        history: list[Message] = [text_message("system", system)]
        async with limit:
            for user in turns:
                history.append(text_message("user", user))
                request = ChatRequest(
                    request_id=uuid.uuid4().hex,
                    model=model,
                    sampling=Sampling(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                    messages=list(history),
                )
                started, first, answer = time.perf_counter(), None, []
                async for chunk in provider.generate(request):
                    if first is None:
                        first = time.perf_counter() - started
                    answer.extend(choice.text for choice in chunk.choices)
                ttfts.append(first or 0.0)
                history.append(text_message("assistant", "".join(answer)))

    await asyncio.gather(*(one(s, t) for s, t in zip(systems, conversations, strict=True)))
    return ttfts


async def run_policy(
    policy: str, redis_url: str, model: str, ports: list[int], args: argparse.Namespace,
    systems: list[str], conversations: list[list[str]],
) -> dict[str, float]:  # fmt: skip
    import redis.asyncio as aioredis

    redis = aioredis.from_url(redis_url)
    provider = PROVIDERS[policy](redis, Settings(redis_url=redis_url), model)
    streams: list[str] = []
    pick = provider._pick_stream

    async def counted(*pick_args: object) -> str:
        streams.append(await pick(*pick_args))  # type: ignore[arg-type]
        return streams[-1]

    provider._pick_stream = counted  # type: ignore[method-assign]
    try:
        for _ in range(300):  # every worker announced itself, publishing KV events
            workers = await provider.live_workers()
            if len(workers) >= len(ports) and all(b.kv_events for b in workers.values()):
                break
            await asyncio.sleep(0.2)
        provider.kv_routing.index.start()
        before = [counters(p) for p in ports]
        ttfts = await converse(
            provider, model, conversations, systems, args.concurrency, args.max_tokens
        )
        after = [counters(p) for p in ports]
        gaps = sum(i.gaps for i in provider.kv_routing.index.indexes.values())
    finally:
        await provider.close()
        await redis.aclose()
    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    ttfts.sort()
    return {
        "hit_rate": round(hits / queries if queries else 0.0, 4),
        "ttft_p50_ms": round(statistics.median(ttfts) * 1000, 1),
        "ttft_p99_ms": round(ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))] * 1000, 1),
        "to_one_worker": round(sum(":w:" in s for s in streams) / max(1, len(streams)), 3),
        "index_gaps": gaps,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-chars", type=int, default=400)
    parser.add_argument("--user-chars", type=int, default=120)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--kv-blocks", type=int, default=160, help="per worker")
    parser.add_argument("--concurrency", type=int, default=8, help="conversations at once")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("SLUICEGATE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"),
    )
    args = parser.parse_args(argv)
    rng = random.Random(0)
    systems = [
        words(rng, args.system_chars, f"Assistant {i} rules:") for i in range(args.conversations)
    ]
    conversations = [
        [words(rng, args.user_chars, f"Turn {t}:") for t in range(args.turns)]
        for _ in range(args.conversations)
    ]
    order = list(range(args.conversations))
    rng.shuffle(order)
    systems = [systems[i] for i in order]
    conversations = [conversations[i] for i in order]

    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = create_demo_model(Path(tmp) / "model")
        for policy in args.policies.split(","):
            model = f"bench-prefix-{uuid.uuid4().hex[:6]}"
            stack = Stack()
            try:
                ports = [free_port() for _ in range(args.workers)]
                for index, port in enumerate(ports):
                    stack.spawn(
                        f"worker{index}",
                        [sys.executable, "-m", "sluicegate.engine.worker", "--model", str(model_dir),
                         "--served-model-name", model, "--redis-url", args.redis_url,
                         "--worker-id", f"{model}-w{index}", "--metrics-port", str(port),
                         "--device", "cpu", "--dtype", "float32", "--num-threads", "1",
                         "--num-kv-blocks", str(args.kv_blocks)],
                        dict(os.environ),
                        Path(tmp) / "logs",
                    )  # fmt: skip
                for port in ports:
                    wait_ready(port)
                results[policy] = asyncio.run(
                    run_policy(policy, args.redis_url, model, ports, args, systems, conversations)
                )
            finally:
                stack.stop()
            print(f"{policy}: {results[policy]}", flush=True)

    print(
        f"{args.conversations} conversations x {args.turns} turns, system ~{args.system_chars} "
        f"chars, {args.workers} workers x {args.kv_blocks} KV blocks, {args.concurrency} at once"
    )
    summary: dict[str, object] = {p: r for p, r in results.items()}
    if "kv_events" in results and "oracle" in results and results["oracle"]["hit_rate"]:
        share = results["kv_events"]["hit_rate"] / results["oracle"]["hit_rate"]
        summary["kv_events_vs_oracle"] = round(share, 4)
    summary.update(
        workers=args.workers,
        conversations=args.conversations,
        turns=args.turns,
        kv_blocks_per_worker=args.kv_blocks,
    )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

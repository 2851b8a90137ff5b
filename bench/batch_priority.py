"""Does a Batch API backlog on our engine leave interactive traffic alone, and still use the
capacity interactive traffic leaves idle?

One engine (a random model, on this machine's CPU) serves, side by side in one run:

- ``interactive``: streamed chat requests arriving as a Poisson process at ``--rate`` a second
  for ``--seconds``, alone;
- ``batch_alone``: ``--lines`` batch requests kept ``--batch-concurrency`` in flight (as the
  gateway's batch runner does, ``SLUICEGATE_BATCH_CONCURRENCY``), alone;
- ``mixed``: the same interactive arrivals while the batch runs at ``BATCH_PRIORITY`` (what
  the gateway gives Batch API lines);
- ``mixed_same_priority``: the same, the batch at the interactive priority (no classes).

Interactive time to first token (p50/p99) is measured per phase, batch tokens/s too. The idle
capacity is what the batch reaches alone less what interactive traffic uses (tokens/s):
``batch_share_of_idle = mixed batch tok/s / (batch_alone tok/s - interactive tok/s)``.
Targets (issue 32): interactive TTFT p99 with the batch <= 1.2x without it, batch share of the
idle capacity >= 0.7. The last line is one JSON object.

    python bench/batch_priority.py --lines 2000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]

from sluicegate.engine import AsyncEngine, SamplingParams  # noqa: E402
from sluicegate.engine.demo_model import create_demo_model  # noqa: E402
from sluicegate.engine.protocol import BATCH_PRIORITY  # noqa: E402
from sluicegate.engine.serving.request_options import RequestOptions  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


class Counter:
    def __init__(self) -> None:
        self.tokens = 0


async def one(
    engine: AsyncEngine,
    prompt: list[int],
    max_tokens: int,
    priority: int,
    counter: Counter,
    ttfts: list[float] | None = None,
) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    began = time.perf_counter()
    first = True
    async for delta in engine.add_request(
        uuid.uuid4().hex, prompt_token_ids=prompt, params=params,
        options=RequestOptions(priority=priority),
    ):  # fmt: skip
        if delta.token_ids:
            if first and ttfts is not None:
                ttfts.append(time.perf_counter() - began)
            first = False
            counter.tokens += len(delta.token_ids)


async def interactive(
    engine: AsyncEngine, args: argparse.Namespace, seed: int, counter: Counter
) -> list[float]:
    rng = random.Random(seed)
    ttfts: list[float] = []
    tasks = []
    deadline = time.perf_counter() + args.seconds
    while time.perf_counter() < deadline:
        prompt = [rng.randrange(3, 500) for _ in range(args.prompt_tokens)]
        tasks.append(asyncio.create_task(one(engine, prompt, args.max_tokens, 0, counter, ttfts)))
        await asyncio.sleep(rng.expovariate(args.rate))
    await asyncio.gather(*tasks)
    return ttfts


async def batch(
    engine: AsyncEngine, args: argparse.Namespace, priority: int, counter: Counter,
    stop: asyncio.Event,
) -> None:  # fmt: skip
    rng = random.Random(7)
    lines = iter(range(args.lines))

    async def runner() -> None:
        for _ in lines:
            if stop.is_set():
                return
            prompt = [rng.randrange(3, 500) for _ in range(args.prompt_tokens)]
            await one(engine, prompt, args.max_tokens, priority, counter)

    await asyncio.gather(*(runner() for _ in range(args.batch_concurrency)))


async def phase(
    engine: AsyncEngine, args: argparse.Namespace, name: str, batch_priority: int | None
) -> dict[str, Any]:
    """Interactive arrivals (unless ``batch_alone``) with the batch running beside them at
    ``batch_priority`` (None: no batch); the batch stops when the arrivals end."""
    users, lines, stop = Counter(), Counter(), asyncio.Event()
    began = time.perf_counter()
    batch_task = None
    if batch_priority is not None:
        batch_task = asyncio.create_task(batch(engine, args, batch_priority, lines, stop))
    ttfts: list[float] = []
    if name == "batch_alone":
        await asyncio.sleep(args.seconds)
    else:
        ttfts = await interactive(engine, args, seed=1, counter=users)
    elapsed = time.perf_counter() - began
    batch_tokens = lines.tokens
    stop.set()
    if batch_task is not None:
        await batch_task
    result = {
        "interactive_tok_s": round(users.tokens / elapsed, 1),
        "batch_tok_s": round(batch_tokens / elapsed, 1),
    }
    if ttfts:
        result.update(
            requests=len(ttfts),
            ttft_p50_ms=round(percentile(ttfts, 0.5) * 1000, 1),
            ttft_p99_ms=round(percentile(ttfts, 0.99) * 1000, 1),
        )
    print(f"{name}: {result}", flush=True)
    return result


async def run(args: argparse.Namespace, model: Path) -> dict[str, Any]:
    engine = AsyncEngine(
        str(model), dtype="float32", num_kv_blocks=args.kv_blocks, max_num_seqs=args.max_num_seqs
    )
    await engine.start()
    try:
        warm = Counter()
        await asyncio.gather(*(one(engine, [5, 6, 7], 4, 0, warm) for _ in range(4)))
        phases = {
            "interactive": await phase(engine, args, "interactive", None),
            "batch_alone": await phase(engine, args, "batch_alone", BATCH_PRIORITY),
            "mixed": await phase(engine, args, "mixed", BATCH_PRIORITY),
            "mixed_same_priority": await phase(engine, args, "mixed_same_priority", 0),
        }
    finally:
        await engine.shutdown()
    alone = phases["interactive"]
    idle = phases["batch_alone"]["batch_tok_s"] - alone["interactive_tok_s"]
    return {
        **{f"{name}_{k}": v for name, figures in phases.items() for k, v in figures.items()},
        "ttft_p99_ratio": round(phases["mixed"]["ttft_p99_ms"] / alone["ttft_p99_ms"], 3),
        "ttft_p99_ratio_same_priority": round(
            phases["mixed_same_priority"]["ttft_p99_ms"] / alone["ttft_p99_ms"], 3
        ),
        "batch_share_of_idle": round(phases["mixed"]["batch_tok_s"] / idle, 3) if idle > 0 else 0,
        "target_ttft_p99_ratio": 1.2,
        "target_batch_share_of_idle": 0.7,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--batch-concurrency", type=int, default=8)
    parser.add_argument("--rate", type=float, default=4.0, help="interactive requests a second")
    parser.add_argument("--seconds", type=float, default=20.0, help="each phase")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--kv-blocks", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = create_demo_model(
            Path(tmp) / "model", hidden_size=256, num_layers=args.layers, num_heads=4,
            num_kv_heads=4,
        )  # fmt: skip
        result = asyncio.run(run(args, model))
    result.update(lines=args.lines, batch_concurrency=args.batch_concurrency, rate=args.rate)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The seed article's scenario, replayed at the scheduler level (block manager + scheduler).

An 80 GB GPU at 0.9 utilisation serving Llama 3.1 8B leaves 426,784 token slots of KV cache
(``sluicegate capacity``). Static reservation of 8,192 tokens per request fits 52 requests in
it; paged allocation fits as many as the tokens actually held allow. Here 1,000 requests
arrive at once (prompts of 1,950..2,050 tokens, 16..64 output tokens) and the real scheduler
runs them to completion with no model: each step appends one random token to every sequence
that samples. Memory alone bounds concurrency (the token budget and max_num_seqs are huge).

Last line: one JSON object with peak_running, peak_kv_utilization, preemptions,
reserved_8192_max_seqs, reserved_131072_max_seqs, finished, ratio_vs_8192.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from sluicegate.engine.core.config import SchedulerConfig
from sluicegate.engine.core.scheduler import Scheduler
from sluicegate.engine.core.sequence import Sequence
from sluicegate.engine.sample.params import SamplingParams

KV_SLOTS = 426_784  # Llama 3.1 8B, 80 GB x 0.9: see `sluicegate capacity`
BLOCK_SIZE = 16
VOCAB = 128_256


def run(num_requests: int, seed: int) -> dict[str, float | int]:
    rng = random.Random(seed)
    config = SchedulerConfig(
        num_kv_blocks=KV_SLOTS // BLOCK_SIZE,
        block_size=BLOCK_SIZE,
        max_model_len=131_072,
        max_num_seqs=1_024,
        max_num_batched_tokens=1_000_000,
        enable_prefix_caching=False,
    )
    scheduler = Scheduler(config)
    for index in range(num_requests):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1_950, 2_050))]
        params = SamplingParams(max_tokens=rng.randint(16, 64), ignore_eos=True)
        scheduler.add(Sequence(f"req-{index}", prompt, params))

    started = time.perf_counter()
    peak_running = steps = finished = 0
    while scheduler.has_unfinished():
        output = scheduler.schedule()
        peak_running = max(peak_running, scheduler.num_running)
        sampled = [rng.randrange(VOCAB) if item.samples else None for item in output.scheduled]
        finished += len(scheduler.postprocess(output, sampled))
        steps += 1
    elapsed = time.perf_counter() - started

    slots = config.num_kv_slots
    reserved_8192, reserved_131072 = slots // 8_192, slots // 131_072
    return {
        "requests": num_requests,
        "kv_slots": slots,
        "kv_blocks": config.num_kv_blocks,
        "steps": steps,
        "scheduler_seconds": round(elapsed, 3),
        "peak_running": peak_running,
        "peak_kv_utilization": round(scheduler.peak_kv_utilization, 4),
        "preemptions": scheduler.num_preemptions,
        "reserved_8192_max_seqs": reserved_8192,
        "reserved_131072_max_seqs": reserved_131072,
        "ratio_vs_8192": round(peak_running / reserved_8192, 2),
        "ratio_vs_131072": round(peak_running / reserved_131072, 2),
        "finished": finished,
    }


def main(argv: list[str] | None = None) -> dict[str, float | int]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    result = run(args.requests, args.seed)
    print(f"KV pool: {result['kv_slots']:,} token slots in {result['kv_blocks']:,} blocks of 16")
    print(
        f"{result['requests']:,} requests, {result['steps']} steps, {result['scheduler_seconds']} s"
    )
    print(f"{'allocation':<32}{'max concurrent':>16}")
    print(f"{'static reservation, 131,072':<32}{result['reserved_131072_max_seqs']:>16,}")
    print(f"{'static reservation, 8,192':<32}{result['reserved_8192_max_seqs']:>16,}")
    print(f"{'paged, on demand (peak)':<32}{result['peak_running']:>16,}")
    print(
        f"paged vs 8,192: {result['ratio_vs_8192']}x, vs 131,072: {result['ratio_vs_131072']}x; "
        f"peak KV utilisation {result['peak_kv_utilization']:.4f}; "
        f"preemptions {result['preemptions']}; finished {result['finished']:,}"
    )
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()

"""The CPU backend's compiled decode kernel against the torch reference, side by side.

One decode step's attention for a batch shaped like bench/engine_throughput.py's model (8 query
heads over 2 KV heads, head_dim 64, 16-token blocks; ``--heads 9 --kv-heads 3`` is SmolLM2)
with context lengths uniform in ``--min-len..--max-len``, the blocks scattered through a larger
cache, queries and cache in ``--dtype`` (float32, bfloat16 or float16: the reference gathers a
16-bit cache into a float32 copy, the kernel reads it in place). The sides run alternately,
``--rounds`` times each; the last line is one JSON object: reference_us, compiled_us (median
per call) and speedup; on a CPU with AVX-512 also compiled_avx2_us, the kernel with its
AVX-512 path turned off, and avx512_speedup. The queries are a view into the rows of a fused
q/k/v product, as in the engine; for a 16-bit dtype also compiled_float_queries_us: the kernel
given float32 queries and its output rounded back, both by torch (what the engine did before
the kernels read 16-bit queries in place). ``--layers N`` gives each call the next of N caches
in turn, as a step's layers do: past the last-level cache the rows then come from memory, as
in the engine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

# Python puts this script's folder first on sys.path, where bench/kernels.py would shadow the
# `kernels` package.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402

from sluicegate.kernels import cpu_attention, reference  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=1)
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    torch.set_num_threads(args.threads)
    if not cpu_attention.available():
        print("the C++ decode kernel could not be built here", file=sys.stderr)
        return 1
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, block_size = args.heads, args.kv_heads, 64, 16
    lens = torch.randint(args.min_len, args.max_len + 1, (args.batch,), generator=generator)
    max_blocks = -(-args.max_len // block_size)
    num_blocks = 2 * args.batch * max_blocks
    shape = (num_blocks, block_size, kv_heads, head_dim)
    caches = [
        (
            torch.randn(shape, generator=generator).to(dtype),
            torch.randn(shape, generator=generator).to(dtype),
        )
        for _ in range(args.layers)
    ]
    tables = torch.randperm(num_blocks, generator=generator)[: args.batch * max_blocks]
    fused = torch.randn(args.batch, (heads + 2 * kv_heads) * head_dim, generator=generator)
    queries = fused.to(dtype)[:, : heads * head_dim].view(args.batch, heads, head_dim)
    steps = [
        (
            queries,
            k_cache,
            v_cache,
            tables.view(args.batch, max_blocks).to(torch.int32),
            lens.to(torch.int32),
            torch.arange(args.batch + 1, dtype=torch.int32),
            head_dim**-0.5,
        )
        for k_cache, v_cache in caches
    ]
    step = steps[0]
    sides = {"reference": reference.paged_attention, "compiled": cpu_attention.paged_attention}
    wide = cpu_attention.allow_avx512(True) and _has_avx512()
    if wide:
        sides["compiled_avx2"] = _without_avx512
    if dtype != torch.float32:
        sides["compiled_float_queries"] = _float_queries
    for name in sides.keys() - {"reference"}:
        torch.testing.assert_close(sides[name](*step), sides["reference"](*step))
    timings: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for round_index in range(args.rounds):
        # Each round starts at another side: whichever runs right after another finds the
        # cache it read still warm (in a large L3 the whole cache fits), so a fixed order
        # would favour the same sides every round.
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            started = time.perf_counter()
            for layer_step in steps:
                sides[name](*layer_step)
            timings[name].append((time.perf_counter() - started) * 1e6 / len(steps))
    medians = {name: statistics.median(values) for name, values in timings.items()}
    for name, median in medians.items():
        print(f"{name}: median {median:,.0f} µs per decode step's attention (one layer)")
    result = {
        "reference_us": round(medians["reference"]),
        "compiled_us": round(medians["compiled"]),
        "speedup": round(medians["reference"] / medians["compiled"], 2),
    }
    if wide:
        result["compiled_avx2_us"] = round(medians["compiled_avx2"])
        result["avx512_speedup"] = round(medians["compiled_avx2"] / medians["compiled"], 2)
    if "compiled_float_queries" in medians:
        result["compiled_float_queries_us"] = round(medians["compiled_float_queries"])
    print(json.dumps(result))
    return 0


def _has_avx512() -> bool:
    return " avx512f " in Path("/proc/cpuinfo").read_text()


def _without_avx512(*args: object) -> torch.Tensor:
    cpu_attention.allow_avx512(False)
    try:
        return cpu_attention.paged_attention(*args)
    finally:
        cpu_attention.allow_avx512(True)


def _float_queries(q: torch.Tensor, *rest: object) -> torch.Tensor:
    return cpu_attention.paged_attention(q.float(), *rest).to(q.dtype)


if __name__ == "__main__":
    sys.exit(main())

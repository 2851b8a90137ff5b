"""The CPU backend's compiled decode kernel against the torch reference, side by side.

One decode step's attention for a batch shaped like bench/engine_throughput.py's model (8 query
heads over 2 KV heads, head_dim 64, 16-token blocks) with context lengths uniform in
``--min-len..--max-len``, the blocks scattered through a larger cache, queries and cache in
``--dtype`` (float32, bfloat16 or float16: the reference gathers a 16-bit cache into a float32
copy, the kernel reads it in place). The two run alternately, ``--rounds`` times each; the
last line is one JSON object: reference_us, compiled_us (median per call) and speedup.
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
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    torch.set_num_threads(args.threads)
    if not cpu_attention.available():
        print("the C++ decode kernel could not be built here", file=sys.stderr)
        return 1
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, block_size = 8, 2, 64, 16
    lens = torch.randint(args.min_len, args.max_len + 1, (args.batch,), generator=generator)
    max_blocks = -(-args.max_len // block_size)
    num_blocks = 2 * args.batch * max_blocks
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    tables = torch.randperm(num_blocks, generator=generator)[: args.batch * max_blocks]
    step = (
        torch.randn(args.batch, heads, head_dim, generator=generator).to(dtype),
        k_cache,
        v_cache,
        tables.view(args.batch, max_blocks).to(torch.int32),
        lens.to(torch.int32),
        torch.arange(args.batch + 1, dtype=torch.int32),
        head_dim**-0.5,
    )
    sides = {"reference": reference.paged_attention, "compiled": cpu_attention.paged_attention}
    torch.testing.assert_close(sides["compiled"](*step), sides["reference"](*step))
    timings: dict[str, list[float]] = {name: [] for name in sides}
    for _ in range(args.rounds):
        for name, attend in sides.items():
            started = time.perf_counter()
            attend(*step)
            timings[name].append((time.perf_counter() - started) * 1e6)
    medians = {name: statistics.median(values) for name, values in timings.items()}
    for name, median in medians.items():
        print(f"{name}: median {median:,.0f} µs per decode step's attention (one layer)")
    print(
        json.dumps(
            {
                "reference_us": round(medians["reference"]),
                "compiled_us": round(medians["compiled"]),
                "speedup": round(medians["reference"] / medians["compiled"], 2),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

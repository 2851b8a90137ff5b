"""The CPU backend's compiled prefill kernel against torch's own CPU flash attention.

One fresh prompt of each ``--lens`` length, causal, in SmolLM2-135M's head shape by default
(9 query heads over 3 KV heads, head_dim 64; ``--heads`` / ``--kv-heads``), its keys and
values in a paged cache of 16-token blocks scattered through the cache, queries and cache in
``--dtype``. The sides:

- ``compiled``: ``sluicegate.kernels.cpu_attention.paged_attention``, reading the paged cache
  in place;
- ``compiled_avx2`` (on a CPU with AVX-512): the same with its AVX-512 path turned off;
- ``compiled_float_scores`` (bfloat16 on a CPU with AVX512_BF16): the same with the scores on
  the float32 tiles instead of the bfloat16 dot products;
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)`` on contiguous
  [1, heads, len, head_dim] tensors, keys and values already repeated to every query head
  outside the timing (its flash kernel takes no grouped heads; with ``enable_gqa`` it falls to
  the plain maths path, several times slower).

Each side's output is checked against ``sdpa``'s first. The sides run alternately,
``--rounds`` times each per length; the last line is one JSON object keyed by length, each
with every side's median milliseconds, its GFLOP/s (4 x len^2 / 2 x heads x head_dim) and
``sdpa_over_compiled`` (above 1: ours faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Python puts this script's folder first on sys.path, where bench/kernels.py would shadow the
# `kernels` package.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from sluicegate.kernels import cpu_attention  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
BLOCK_SIZE = 16
HEAD_DIM = 64
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lens", default="512,2048,8192", help="prompt lengths, in tokens")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_attention.available():
        print("the C++ attention kernels could not be built here", file=sys.stderr)
        return 1
    dtype = DTYPES[args.dtype]
    cpuinfo = Path("/proc/cpuinfo").read_text()
    wide = cpu_attention.allow_avx512(True) and " avx512f " in cpuinfo
    dots = (
        dtype == torch.bfloat16
        and cpu_attention.allow_bf16_dots(True)
        and " avx512_bf16 " in cpuinfo
    )
    result: dict[str, dict[str, float]] = {}
    for length in (int(n) for n in args.lens.split(",")):
        sides = _sides(length, args.heads, args.kv_heads, dtype, wide, dots)
        want = sides["sdpa"]()
        for name, run in sides.items():
            torch.testing.assert_close(
                run().float(),
                want.float(),
                atol=TOLERANCE[dtype],
                rtol=TOLERANCE[dtype],
                msg=lambda message, name=name, length=length: f"{name}, {length} tokens: {message}",
            )
        timings: dict[str, list[float]] = {name: [] for name in sides}
        names = list(sides)
        for round_index in range(args.rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                started = time.perf_counter()
                sides[name]()
                timings[name].append(time.perf_counter() - started)
        flops = 4 * length * length / 2 * args.heads * HEAD_DIM
        row: dict[str, float] = {}
        for name, values in timings.items():
            seconds = statistics.median(values)
            row[f"{name}_ms"] = round(seconds * 1e3, 2)
            row[f"{name}_gflops"] = round(flops / seconds / 1e9, 1)
        row["sdpa_over_compiled"] = round(row["sdpa_ms"] / row["compiled_ms"], 3)
        print(f"{length} tokens: {row}", flush=True)
        result[str(length)] = row
    print(json.dumps(result))
    return 0


def _sides(
    length: int, heads: int, kv_heads: int, dtype: torch.dtype, wide: bool, dots: bool
) -> dict[str, Callable[[], torch.Tensor]]:
    generator = torch.Generator().manual_seed(length)
    num_blocks = -(-length // BLOCK_SIZE)
    shape = (2 * num_blocks, BLOCK_SIZE, kv_heads, HEAD_DIM)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    table = torch.randperm(2 * num_blocks, generator=generator)[:num_blocks].to(torch.int32)
    q = torch.randn(length, heads, HEAD_DIM, generator=generator).to(dtype)
    lens = torch.tensor([length], dtype=torch.int32)
    cu = torch.tensor([0, length], dtype=torch.int32)
    scale = HEAD_DIM**-0.5

    def compiled() -> torch.Tensor:
        return cpu_attention.paged_attention(q, k_cache, v_cache, table[None], lens, cu, scale)

    def switched_off(allow: Callable[[bool], bool]) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            allow(False)
            try:
                return compiled()
            finally:
                allow(True)

        return run

    def gathered(cache: torch.Tensor) -> torch.Tensor:
        rows = cache[table.long()].reshape(-1, kv_heads, HEAD_DIM)[:length]
        return rows.transpose(0, 1).repeat_interleave(heads // kv_heads, 0).contiguous()[None]

    keys, values = gathered(k_cache), gathered(v_cache)
    queries = q.transpose(0, 1).contiguous()[None]

    def sdpa() -> torch.Tensor:
        out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale)
        return out[0].transpose(0, 1)

    sides = {"compiled": compiled, "sdpa": sdpa}
    if wide:
        sides["compiled_avx2"] = switched_off(cpu_attention.allow_avx512)
    if dots:
        sides["compiled_float_scores"] = switched_off(cpu_attention.allow_bf16_dots)
    return sides


if __name__ == "__main__":
    sys.exit(main())

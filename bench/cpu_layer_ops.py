"""The CPU layer ops' AVX-512 rows against their AVX2 rows and eager torch, side by side.

RMSNorm, the residual add fused with RMSNorm, and SiLU x mul (``sluicegate.kernels.cpu_ops``)
at ``--rows`` rows of ``--hidden`` (the norms) and ``2 x --intermediate`` (SiLU x mul) values,
``--dtype`` bfloat16 or float16, on torch's threads: the compiled kernels with their AVX-512
rows (where the CPU has AVX-512), the same kernels with those turned off, and the torch code
they stand in for (``sluicegate.engine.models.layers``). Sides alternate, ``--rounds`` times;
the last line is one JSON object: per op and row count, each side's median µs.

    python bench/cpu_layer_ops.py --dtype bfloat16 --hidden 576 --intermediate 1536
"""

from __future__ import annotations

import argparse
import json
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

from sluicegate.engine.models.layers import RMSNorm  # noqa: E402
from sluicegate.kernels import cpu_ops  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def _median_us(run: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def _with_avx512(allow: bool, run: Callable[[], object]) -> Callable[[], object]:
    def switched() -> object:
        previous = cpu_ops.allow_avx512(allow)
        try:
            return run()
        finally:
            cpu_ops.allow_avx512(previous)

    return switched


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--rows", default="1,16,64,512,2048")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    if not cpu_ops.supports(torch.zeros(1, dtype=dtype)):
        print("the CPU kernels could not be built here", file=sys.stderr)
        return 1
    norm = RMSNorm(args.hidden, 1e-5).to(dtype)
    results: dict[str, dict[str, dict[str, float]]] = {}
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, args.hidden).to(dtype)
            residual = torch.randn(rows, args.hidden).to(dtype)
            gate_up = torch.randn(rows, 2 * args.intermediate).to(dtype)
            half = args.intermediate
            ops: dict[str, dict[str, Callable[[], object]]] = {
                "rms_norm": {
                    "compiled": lambda x=x: cpu_ops.rms_norm(x, norm.weight, norm.eps),
                    "torch": lambda x=x: norm._normalize(x),
                },
                # In place on copies, so every call sees the same values.
                "add_rms_norm": {
                    "compiled": lambda x=x, r=residual: cpu_ops.add_rms_norm_(
                        x.clone(), r.clone(), norm.weight, norm.eps
                    ),
                    "torch": lambda x=x, r=residual: norm._normalize(r + x),
                },
                "silu_and_mul": {
                    "compiled": lambda g=gate_up: cpu_ops.silu_and_mul(g),
                    "torch": lambda g=gate_up, h=half: F.silu(g[:, :h]) * g[:, h:],
                },
            }
            for op, runs in ops.items():
                sides = {
                    "avx512": _with_avx512(True, runs["compiled"]),
                    "avx2": _with_avx512(False, runs["compiled"]),
                    "torch": runs["torch"],
                }
                timings: dict[str, list[float]] = {side: [] for side in sides}
                names = list(sides)
                for round_index in range(args.rounds):
                    shift = round_index % len(names)
                    for side in names[shift:] + names[:shift]:
                        sides[side]()
                        timings[side].append(_median_us(sides[side], args.repeats))
                medians = {side: round(statistics.median(t), 1) for side, t in timings.items()}
                results.setdefault(op, {})[str(rows)] = medians
                print(
                    f"{op} at {rows} rows: " + ", ".join(f"{s} {v} µs" for s, v in medians.items())
                )
    print(json.dumps({"dtype": args.dtype, "threads": torch.get_num_threads(), "ops": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

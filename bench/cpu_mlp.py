"""A 16-bit gated MLP on the CPU, split into column halves on two threads in one parallel region
(``sluicegate.engine.models.cpu.split_mlp``) against the same MLP unsplit, side by side.

``--layers`` MLPs of SmolLM2's shape by default (hidden 576, intermediate 1536) with random
weights in ``--dtype``, run one after another as a decode step runs them, so their weights
stream from memory as in the engine rather than sitting in cache. Unsplit is what the engine
ran before: oneDNN's gate/up product, the C++ SiLU x mul and oneDNN's down product, each on
one thread or all as the engine's start-up timing chose for it
(``sluicegate.engine.models.cpu.threads``). The sides alternate, ``--rounds`` times, at each
of ``--rows``; run it as the engine runs (``OMP_WAIT_POLICY=PASSIVE`` is set when unset).
The last line is one JSON object: per row count, the median µs per MLP of each side and the
speedup.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Python puts this script's folder first on sys.path, where bench/kernels.py would shadow the
# `kernels` package.
sys.path[0] = str(Path(__file__).resolve().parent.parent)

import torch  # noqa: E402
from torch import nn  # noqa: E402

from sluicegate.engine.models.cpu.linears import choose_threads  # noqa: E402
from sluicegate.engine.models.cpu.onednn import OneDNNLinear, packs  # noqa: E402
from sluicegate.engine.models.cpu.split_mlp import SplitMLP, splittable  # noqa: E402
from sluicegate.engine.models.layers import GatedMLP  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rows", default="1,8,32,64,256,2048")
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    if torch.get_num_threads() < 2 or not packs(dtype):
        print(f"needs two threads and oneDNN packing {args.dtype} here", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    unsplit, split = nn.ModuleList(), []
    for _ in range(args.layers):
        mlp = GatedMLP(args.hidden, args.intermediate, bias=False, act="silu").to(dtype)
        with torch.no_grad():
            mlp.gate_up_proj.weight.normal_(0, 0.05)
            mlp.down_proj.weight.normal_(0, 0.05)
        assert splittable(mlp)
        split.append(SplitMLP(mlp.gate_up_proj, mlp.down_proj))
        mlp.gate_up_proj = OneDNNLinear(mlp.gate_up_proj)
        mlp.down_proj = OneDNNLinear(mlp.down_proj)
        unsplit.append(mlp)
    choose_threads(unsplit, dtype)
    sides = {"unsplit": list(unsplit), "split": split}
    result: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, args.hidden).to(dtype)
            torch.testing.assert_close(split[0](x), unsplit[0](x), rtol=2e-2, atol=2e-2)
            times: dict[str, list[float]] = {name: [] for name in sides}
            for _ in range(args.rounds):
                for name, mlps in sides.items():
                    began = time.perf_counter()
                    for mlp in mlps:
                        mlp(x)
                    times[name].append((time.perf_counter() - began) / len(mlps) * 1e6)
            medians = {name: statistics.median(values) for name, values in times.items()}
            print(
                f"{rows} rows: unsplit {medians['unsplit']:,.0f} µs, split "
                f"{medians['split']:,.0f} µs an MLP"
            )
            result[str(rows)] = {
                "unsplit_us": round(medians["unsplit"]),
                "split_us": round(medians["split"]),
                "speedup": round(medians["unsplit"] / medians["split"], 2),
            }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A decoder layer's tail on the CPU in 16 bits (output projection, residual add and RMSNorm,
gated MLP) three ways, side by side: unsplit, with the MLP split into column halves on two
threads in one parallel region (``sluicegate.engine.models.cpu.split_mlp``, ``SplitMLP``), and
with the whole tail in that region (``SplitLayerTail``); on a CPU with AVX512_BF16 in bfloat16
also ``split_tail_pairs``: that region with the products on the CPU's bfloat16 dot products
(``sluicegate.kernels.cpu_pair_linear``) instead of oneDNN.

``--layers`` tails of SmolLM2's shape by default (hidden 576, attention output 576,
intermediate 1536) with random weights in ``--dtype``, run one after another as a decode step
runs them, so their weights stream from memory as in the engine rather than sitting in cache.
Unsplit is oneDNN's products and the C++ layer ops, each on one thread or all as the engine's
start-up timing chose for it (``sluicegate.engine.models.cpu.threads``); the split MLP keeps
that output projection. The sides alternate, each round starting at another, ``--rounds``
times at each of ``--rows``; run it as the engine runs (``OMP_WAIT_POLICY=PASSIVE`` is set
when unset). The last line is one JSON object: per row count, the median µs per layer of each
side and the speedups over unsplit.
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
from sluicegate.engine.models.cpu.split_mlp import SplitLayerTail, splittable  # noqa: E402
from sluicegate.engine.models.layers import GatedMLP, RMSNorm  # noqa: E402
from sluicegate.kernels import cpu_pair_linear  # noqa: E402

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
    pairs = dtype == torch.bfloat16 and cpu_pair_linear.available()
    unsplit, split_mlps, tails, pair_tails = [], [], [], []
    for _ in range(args.layers):
        o_proj = nn.Linear(args.hidden, args.hidden, bias=False).to(dtype)
        norm = RMSNorm(args.hidden, 1e-5).to(dtype)
        mlp = GatedMLP(args.hidden, args.intermediate, bias=False, act="silu").to(dtype)
        with torch.no_grad():
            for linear in (o_proj, mlp.gate_up_proj, mlp.down_proj):
                linear.weight.normal_(0, 0.05)
        assert splittable(mlp)
        tails.append(SplitLayerTail(o_proj, norm, mlp))
        if pairs:
            pair_tails.append(SplitLayerTail(o_proj, norm, mlp, cpu_pair_linear.pack))
        split_mlps.append(_Tail(OneDNNLinear(o_proj), norm, tails[-1].mlp))
        mlp.gate_up_proj = OneDNNLinear(mlp.gate_up_proj)
        mlp.down_proj = OneDNNLinear(mlp.down_proj)
        unsplit.append(_Tail(split_mlps[-1].o_proj, norm, mlp))
    choose_threads(nn.ModuleList(unsplit), dtype)
    sides: dict[str, list[nn.Module]] = {
        "unsplit": unsplit,
        "split_mlp": split_mlps,
        "split_tail": tails,
    }
    if pairs:
        sides["split_tail_pairs"] = pair_tails
    result: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for rows in (int(r) for r in args.rows.split(",")):
            attn = torch.randn(rows, args.hidden).to(dtype)
            residual = torch.randn(rows, args.hidden).to(dtype)
            reference = unsplit[0](attn, residual.clone())
            for name in list(sides)[1:]:
                torch.testing.assert_close(
                    sides[name][0](attn, residual.clone()), reference, rtol=2e-2, atol=2e-2
                )
            times: dict[str, list[float]] = {name: [] for name in sides}
            names = list(sides)
            for round_index in range(args.rounds):
                shift = round_index % len(names)
                for name in names[shift:] + names[:shift]:
                    began = time.perf_counter()
                    for tail in sides[name]:
                        tail(attn, residual)
                    times[name].append((time.perf_counter() - began) / args.layers * 1e6)
            medians = {name: statistics.median(values) for name, values in times.items()}
            print(
                f"{rows} rows: "
                + ", ".join(f"{n} {m:,.0f} µs" for n, m in medians.items())
                + " a layer's tail"
            )
            result[str(rows)] = {f"{n}_us": round(m) for n, m in medians.items()}
            for name in list(sides)[1:]:
                result[str(rows)][f"{name}_speedup"] = round(medians["unsplit"] / medians[name], 2)
    print(json.dumps(result))
    return 0


class _Tail(nn.Module):
    """Output projection, residual add with RMSNorm and MLP as ``DecoderLayer`` runs them
    when its tail is not split; returns the MLP's output and the residual, updated in place
    (repeated rounds keep adding to it, on every side alike)."""

    def __init__(self, o_proj: nn.Module, norm: RMSNorm, mlp: nn.Module) -> None:
        super().__init__()
        self.o_proj, self.norm, self.mlp = o_proj, norm, mlp

    def forward(
        self, attn: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.norm(self.o_proj(attn), residual)
        return self.mlp(x), residual


if __name__ == "__main__":
    sys.exit(main())

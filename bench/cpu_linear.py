"""The CPU linear kernels side by side: packed (``sluicegate.kernels.cpu_linear``), oneDNN and aten
(and, on a CPU with AVX-512, the packed product held to its AVX2 tiles: ``packed_avx2``).

One "step" runs every linear of a decode step of bench/vs_vllm.py's model (4 layers of hidden
512 with qkv 768, o 512, gate_up 2816, down 1408 -> 512, and the 512 x 32000 LM head) on
``--rows`` rows, all float32, 111 MB of weights: more than the last-level cache, so each step
streams them from memory as the engine's decode steps do. A prefill step ("prefill") runs the
layers on 2,048 rows and the LM head on 32 (a step samples only its requests' last tokens).
The kernels take turns step by step, ``--rounds`` times each, so that this shared machine's
drift touches them alike. The last line is one JSON object: per case each kernel's median
milliseconds per step and packed's speedup over oneDNN.
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

from sluicegate.engine.models.onednn import OneDNNLinear  # noqa: E402
from sluicegate.kernels import cpu_linear  # noqa: E402

LAYER_SHAPES = [(512, 768), (512, 512), (512, 2816), (1408, 512)]
LM_HEAD = (512, 32000)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,16,22,32,64,256,prefill")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu_linear.available():
        print("the packed linear could not be built here (compiler, AVX2, FMA)", file=sys.stderr)
        return 1
    generator = torch.Generator().manual_seed(0)
    shapes = LAYER_SHAPES * args.layers + [LM_HEAD]
    weights = [torch.randn(n, k, generator=generator) / k**0.5 for k, n in shapes]
    packed = [cpu_linear.pack(w) for w in weights]
    onednn = [OneDNNLinear(_linear_with(w)) for w in weights]
    kernels: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = {
        "packed": [lambda x, p=p: cpu_linear.linear(x, p) for p in packed],
        "onednn": list(onednn),
        "aten": [lambda x, w=w: F.linear(x, w) for w in weights],
    }
    if cpu_linear.isa() == "avx512":  # the packed product's AVX2 tiles too, for comparison
        kernels["packed_avx2"] = [lambda x, p=p: _avx2_linear(x, p) for p in packed]
    result: dict[str, dict[str, float]] = {}
    for case in args.rows.split(","):
        rows, head_rows = (2048, 32) if case == "prefill" else (int(case), int(case))
        layer_inputs = {k: torch.randn(rows, k, generator=generator) for k, _ in LAYER_SHAPES}
        head_input = torch.randn(head_rows, LM_HEAD[0], generator=generator)
        inputs = [layer_inputs[k] for k, _ in shapes[:-1]] + [head_input]
        for name, step in kernels.items():  # agreement first: one product, three kernels
            out = step[-1](head_input)
            expected = F.linear(head_input.double(), weights[-1].double())
            torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4, msg=name)
        times: dict[str, list[float]] = {name: [] for name in kernels}
        with torch.inference_mode():
            for _ in range(args.rounds + 1):  # the first round warms up
                for name, step in kernels.items():
                    began = time.perf_counter()
                    for x, linear in zip(inputs, step, strict=True):
                        linear(x)
                    times[name].append(time.perf_counter() - began)
        medians = {name: statistics.median(t[1:]) * 1000 for name, t in times.items()}
        line = {f"{name}_ms": round(ms, 3) for name, ms in medians.items()}
        line["speedup_vs_onednn"] = round(medians["onednn"] / medians["packed"], 3)
        print(f"rows {case}: " + ", ".join(f"{k} {v}" for k, v in line.items()), flush=True)
        result[case] = line
    print(json.dumps(result))
    return 0


def _avx2_linear(x: torch.Tensor, packed: cpu_linear.PackedWeight) -> torch.Tensor:
    previous = cpu_linear.allow_avx512(False)
    try:
        return cpu_linear.linear(x, packed)
    finally:
        cpu_linear.allow_avx512(previous)


def _linear_with(weight: torch.Tensor) -> torch.nn.Linear:
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight.data = weight
    return linear


if __name__ == "__main__":
    raise SystemExit(main())

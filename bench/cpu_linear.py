"""The CPU linear kernels side by side: packed (``sluicegate.kernels.cpu_linear``), oneDNN and aten
(and, on a CPU with AVX-512, the packed product held to its AVX2 tiles: ``packed_avx2``).

One "step" runs every linear of a decode step of bench/vs_vllm.py's model (4 layers of hidden
512 with qkv 768, o 512, gate_up 2816, down 1408 -> 512, and the 512 x 32000 LM head) on
``--rows`` rows, 111 MB of float32 weights: more than the last-level cache, so each step
streams them from memory as the engine's decode steps do. A prefill step ("prefill") runs the
layers on 2,048 rows and the LM head on 32 (a step samples only its requests' last tokens).
The kernels take turns step by step, ``--rounds`` times each, so that this shared machine's
drift touches them alike. The last line is one JSON object: per case each kernel's median
milliseconds per step and packed's speedup over oneDNN.

``--dtype bfloat16`` or ``float16``: weights and rows in that dtype (56 MB), the packed
product's panels too; against aten's 16-bit linear (torch's own, which is oneDNN's where the
CPU has 16-bit instructions), oneDNN through ``OneDNNLinear`` where it takes the dtype here,
and the packed product on the float32 weights (``packed_float32``, float32 rows): the
speedups are over aten and over that float32 packed product.
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

from sluicegate.engine.models.cpu.onednn import OneDNNLinear  # noqa: E402
from sluicegate.kernels import cpu_linear  # noqa: E402

LAYER_SHAPES = [(512, 768), (512, 512), (512, 2816), (1408, 512)]
LM_HEAD = (512, 32000)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The agreement check: float32 sums, or a product rounded to a 16-bit dtype.
TOLERANCES = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
    torch.float16: {"atol": 3e-3, "rtol": 3e-3},
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,16,22,32,64,256,prefill")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    torch.set_num_threads(args.threads)
    if not cpu_linear.available():
        print("the packed linear could not be built here (compiler, AVX2, FMA)", file=sys.stderr)
        return 1
    generator = torch.Generator().manual_seed(0)
    shapes = LAYER_SHAPES * args.layers + [LM_HEAD]
    weights = [(torch.randn(n, k, generator=generator) / k**0.5).to(dtype) for k, n in shapes]
    packed = [cpu_linear.pack(w) for w in weights]
    kernels: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = {
        "packed": [lambda x, p=p: cpu_linear.linear(x, p) for p in packed],
    }
    try:
        kernels["onednn"] = [OneDNNLinear(_linear_with(w)) for w in weights]
    except RuntimeError as exc:  # oneDNN's 16-bit path needs CPU instructions this one lacks
        print(f"oneDNN left out: {exc}", flush=True)
    kernels["aten"] = [lambda x, w=w: F.linear(x, w) for w in weights]
    if dtype != torch.float32:  # what the 16-bit panels save: the float32 packed product
        wide = [cpu_linear.pack(w.float()) for w in weights]
        kernels["packed_float32"] = [lambda x, p=p: cpu_linear.linear(x.float(), p) for p in wide]
    if cpu_linear.isa() == "avx512":  # the packed product's AVX2 tiles too, for comparison
        kernels["packed_avx2"] = [lambda x, p=p: _avx2_linear(x, p) for p in packed]
    compared = ("onednn",) if dtype == torch.float32 else ("onednn", "aten", "packed_float32")
    result: dict[str, dict[str, float]] = {}
    for case in args.rows.split(","):
        rows, head_rows = (2048, 32) if case == "prefill" else (int(case), int(case))
        layer_inputs = {
            k: torch.randn(rows, k, generator=generator).to(dtype) for k, _ in LAYER_SHAPES
        }
        head_input = torch.randn(head_rows, LM_HEAD[0], generator=generator).to(dtype)
        inputs = [layer_inputs[k] for k, _ in shapes[:-1]] + [head_input]
        for name, step in kernels.items():  # agreement first: one product, every kernel
            out = step[-1](head_input)
            expected = F.linear(head_input.double(), weights[-1].double())
            tolerance = TOLERANCES[out.dtype]
            torch.testing.assert_close(out.double(), expected, **tolerance, msg=name)
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
        for other in compared:
            if other in medians:
                line[f"speedup_vs_{other}"] = round(medians[other] / medians["packed"], 3)
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

"""What a quantized checkpoint's CPU linears cost: the dequantize-per-call path of
``sluicegate.engine.models.quant`` (fp8 per channel; int4 in groups of 64, as the SmolLM2 test
checkpoint), its dequantization by the C++ pass (``fp8``, ``int4``) and by torch
(``fp8_torch``, ``int4_torch``), against dense float32 and bfloat16 ``F.linear`` on the same
shapes.

One "step" runs every projection of ``--layers`` SmolLM2-135M layers (hidden 576: qkv 960,
o 576, gate 1536, up 1536, down 576 from 1536) on ``--rows`` activation rows in float32; the
cases take turns step by step, ``--rounds`` times each. Reports each case's median
milliseconds per step and the bytes its weights hold. The last line is one JSON object.
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

from sluicegate.engine.models.quant.linear import QuantizedLinear  # noqa: E402
from sluicegate.engine.models.quant.scheme import QuantScheme  # noqa: E402
from sluicegate.kernels import quant_dequant  # noqa: E402

# (inputs, outputs) of one SmolLM2-135M layer's checkpoint linears.
SHAPES = [(576, 576), (576, 192), (576, 192), (576, 576), (576, 1536), (576, 1536), (1536, 576)]
SCHEMES = {
    "fp8": QuantScheme("compressed-tensors", "fp8", 8),
    "int4": QuantScheme("compressed-tensors", "pack-quantized", 4, group_size=64),
}


def quantized(scheme: QuantScheme, inputs: int, outputs: int) -> QuantizedLinear:
    """Random storage of the right shapes: the cost does not depend on the values."""
    linear = QuantizedLinear(scheme, inputs, outputs)
    with torch.no_grad():
        for param in linear.parameters():
            if param.dtype == torch.float8_e4m3fn:
                param.copy_(torch.randn(param.shape).to(torch.float8_e4m3fn))
            elif param.is_floating_point():
                param.copy_(torch.rand(param.shape) * 0.01)
            else:
                param.copy_(torch.randint(0, 255, param.shape))
    return linear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    shapes = SHAPES * args.layers
    dense32 = [torch.randn(o, i) * 0.02 for i, o in shapes]
    dense16 = [w.bfloat16() for w in dense32]
    linears = {name: [quantized(s, i, o) for i, o in shapes] for name, s in SCHEMES.items()}

    def step(kind: str, x32: torch.Tensor, x16: torch.Tensor) -> Callable[[], None]:
        def run() -> None:
            with torch.inference_mode():
                if kind == "float32":
                    for w in dense32:
                        F.linear(x32[:, : w.shape[1]], w)
                elif kind == "bfloat16":
                    for w in dense16:
                        F.linear(x16[:, : w.shape[1]], w)
                else:
                    for linear in linears[kind.removesuffix("_torch")]:
                        linear(x32[:, : linear.in_features])

        if not kind.endswith("_torch"):
            return run

        def torch_only() -> None:
            compiled = quant_dequant.supports
            quant_dequant.supports = lambda _: False  # type: ignore[assignment]
            try:
                run()
            finally:
                quant_dequant.supports = compiled  # type: ignore[assignment]

        return torch_only

    weight_bytes = {
        "float32": sum(w.numel() * 4 for w in dense32),
        "bfloat16": sum(w.numel() * 2 for w in dense16),
        **{
            name: sum(p.numel() * p.element_size() for m in ms for p in m.parameters())
            for name, ms in linears.items()
        },
    }
    result: dict[str, object] = {"layers": args.layers, "weight_bytes": weight_bytes}
    for rows in args.rows:
        x32 = torch.randn(rows, 1536)
        x16 = x32.bfloat16()
        kinds = ("float32", "bfloat16", *SCHEMES, *(f"{name}_torch" for name in SCHEMES))
        cases = {kind: step(kind, x32, x16) for kind in kinds}
        times: dict[str, list[float]] = {kind: [] for kind in cases}
        for run in cases.values():
            run()  # warm-up
        for _ in range(args.rounds):
            for kind, run in cases.items():
                start = time.perf_counter()
                run()
                times[kind].append((time.perf_counter() - start) * 1e3)
        medians = {kind: round(statistics.median(t), 3) for kind, t in times.items()}
        print(f"rows {rows}: " + ", ".join(f"{k} {v} ms" for k, v in medians.items()))
        result[f"rows_{rows}_ms"] = medians
    print(json.dumps(result))


if __name__ == "__main__":
    main()

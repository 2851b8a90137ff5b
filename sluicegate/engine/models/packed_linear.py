"""``PackedLinear``: an ``nn.Linear`` run by the compiled packed-weight product
(``sluicegate.kernels.cpu_linear``); ``SplitLinear``: the packed product for few rows, torch's
own 16-bit linear for many."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sluicegate.kernels import cpu_ops


class PackedLinear(nn.Module):
    """An ``nn.Linear`` whose weight and bias were packed once for ``sluicegate.kernels.cpu_linear``;
    ``gated``: a gated MLP's gate_up_proj, returning silu(gate) * up (half as wide)."""

    def __init__(self, linear: nn.Linear, gated: bool = False) -> None:
        from sluicegate.kernels import cpu_linear

        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features // 2 if gated else linear.out_features
        self._linear = cpu_linear.linear
        self.packed = cpu_linear.pack(linear.weight, linear.bias, gated=gated)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.packed)


class SplitLinear(nn.Module):
    """A bfloat16 or float16 ``nn.Linear`` run by the packed product below ``min_rows`` rows
    (decode steps, where streaming 16-bit weights pays) and by torch's own 16-bit linear from
    ``min_rows`` on (prefill chunks, compute-bound, where oneDNN's GEMM can use the CPU's
    16-bit dot products and the packed product widens to float32). It holds both the packed
    copy and the original weight: twice the linears' memory, the price of the faster kernel
    at each size. ``gated`` as for ``PackedLinear``."""

    def __init__(self, linear: nn.Linear, min_rows: int, gated: bool = False) -> None:
        super().__init__()
        self.packed = PackedLinear(linear, gated=gated)
        # The weight itself, not the nn.Linear: a module holding an nn.Linear would be
        # swapped again by a walk that swaps every nn.Linear it finds.
        self.weight = linear.weight
        self.bias = linear.bias
        self.min_rows = min_rows
        self.gated = gated
        self.in_features = linear.in_features
        self.out_features = self.packed.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() < self.min_rows * self.in_features:
            return self.packed(x)
        out = F.linear(x, self.weight, self.bias)
        if not self.gated:
            return out
        if cpu_ops.supports(out):
            return cpu_ops.silu_and_mul(out)
        gate, up = out.split(self.out_features, dim=-1)
        return F.silu(gate) * up

"""``PackedLinear``: an ``nn.Linear`` run by the compiled packed-weight product
(``sluicegate.kernels.cpu_linear``)."""

from __future__ import annotations

import torch
from torch import nn

from sluicegate.engine.models.cpu.threads import on_one_thread


class PackedLinear(nn.Module):
    """An ``nn.Linear`` whose weight and bias were packed once for ``sluicegate.kernels.cpu_linear``;
    ``gated``: a gated MLP's gate_up_proj, returning silu(gate) * up (half as wide)."""

    def __init__(self, linear: nn.Linear, gated: bool = False) -> None:
        from sluicegate.kernels import cpu_linear

        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features // 2 if gated else linear.out_features
        self.input_dtype = linear.weight.dtype
        self.serial_rows = 0
        """Up to this many rows run on one thread (``sluicegate.engine.models.cpu.threads``)."""
        self._linear = cpu_linear.linear
        self.packed = cpu_linear.pack(linear.weight, linear.bias, gated=gated)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() // self.in_features <= self.serial_rows:
            return on_one_thread(self._product, x)
        return self._product(x)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.packed)

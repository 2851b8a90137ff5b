"""``PairLinear``: a bfloat16 ``nn.Linear`` run by the CPU's bfloat16 dot products
(``sluicegate.kernels.cpu_pair_linear``)."""

from __future__ import annotations

import torch
from torch import nn

from sluicegate.engine.models.cpu.threads import on_one_thread
from sluicegate.kernels import cpu_pair_linear


def pairs_take(linear: nn.Module) -> bool:
    """A plain bias-free bfloat16 linear on the CPU, where the CPU has the dot products."""
    return (
        type(linear) is nn.Linear
        and linear.bias is None
        and linear.weight.dtype == torch.bfloat16
        and linear.weight.device.type == "cpu"
        and cpu_pair_linear.available()
    )


class PairLinear(nn.Module):
    """An ``nn.Linear`` (bfloat16, no bias) whose weight was packed once in k pairs."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        assert linear.bias is None, "PairLinear takes bias-free linears"
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.input_dtype = linear.weight.dtype
        self.serial_rows = 0
        """Up to this many rows run on one thread (``sluicegate.engine.models.cpu.threads``)."""
        self.packed = cpu_pair_linear.pack(linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() // self.in_features <= self.serial_rows:
            return on_one_thread(self._product, x)
        return self._product(x)

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_pair_linear.linear(x, self.packed, self.out_features)

"""CPU linears through oneDNN with the weight packed once, instead of aten's default GEMM (one
of the engine's CPU linear kernels: see ``sluicegate.engine.models.cpu.linears``).

On this project's CPUs (AMD EPYC) oneDNN's JIT kernels run the engine's small-batch float32
linears (tens of rows against a 512x32000 or 512x2816 weight) about 1.3-1.9x faster than
aten's. In bfloat16 aten's linear is oneDNN's GEMM too, but with the weight in plain layout:
every call reorders it into the blocked pairs ``vdpbf16ps`` reads. Packed once, a decode
step's products ran 1.1-2.4x faster, bit for bit the same (``bench/cpu_linear.py``).
"""

from __future__ import annotations

import torch
from torch import nn

from sluicegate.engine.models.cpu.threads import on_one_thread

_HAS_POINTWISE = hasattr(torch.ops.mkldnn, "_linear_pointwise")
_HAS_REORDER = hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
# The batch size oneDNN picks the packed layout for (any from 32 up measured alike).
_PACK_BATCH_SIZE = 256


def packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN on this CPU packs a ``dtype`` weight (16-bit ones need the CPU's
    16-bit dot products: bfloat16 on AVX-512 machines, float16 only with AVX512-FP16)."""
    if not (_HAS_POINTWISE and _HAS_REORDER and torch.backends.mkldnn.is_available()):
        return dtype == torch.float32 and torch.backends.mkldnn.is_available()
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), 1)
    except RuntimeError:
        return False
    return True


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A linear's weight [out, in] as oneDNN takes it: packed, where torch has the op."""
    weight = weight.contiguous()
    if _HAS_POINTWISE and _HAS_REORDER:
        return torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_SIZE)
    return weight.to_mkldnn()


class OneDNNLinear(nn.Module):
    """An ``nn.Linear`` whose weight (and bias) were converted once to oneDNN tensors, the
    weight packed."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.input_dtype = linear.weight.dtype
        self.serial_rows = 0
        """Up to this many rows run on one thread (``sluicegate.engine.models.cpu.threads``)."""
        self.weight = pack_weight(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous().to_mkldnn()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        if rows.shape[0] <= self.serial_rows:
            out = on_one_thread(self._product, rows)
        else:
            out = self._product(rows)
        return out.view(*x.shape[:-1], self.out_features)

    def _product(self, rows: torch.Tensor) -> torch.Tensor:
        if _HAS_POINTWISE:
            # Inductor's op: dense input and output, so no per-call format conversions.
            return torch.ops.mkldnn._linear_pointwise(rows, self.weight, self.bias, "none", [], "")
        return torch._C._nn.mkldnn_linear(rows.to_mkldnn(), self.weight, self.bias).to_dense()

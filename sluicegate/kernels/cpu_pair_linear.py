"""Bfloat16 linears on the CPU with its bfloat16 dot products (``csrc/linear/pair_linear.cpp``:
AVX512_BF16's ``vdpbf16ps``, two multiply-adds of bfloat16 pairs an instruction);
``torch.nn.functional.linear`` is its reference.

oneDNN's bfloat16 GEMM uses the same instruction; on a 2-core AVX-512 AMD EPYC with
``avx512_bf16`` this kernel ran a decoder layer's tail (SmolLM2's shapes, weights streamed
from memory) 1.59x faster at 1 row, 1.13-1.18x at 32-64 rows and 1.05x at 2,048
(``bench/cpu_mlp.py``). Weights are packed once in panels of 16 columns holding each column's
k pairs side by side, the layout the instruction reads. Part of
the CPU kernels' extension (``sluicegate.kernels.cpu_build``); ``available()`` is False without
a compiler or on a CPU without AVX512_BF16.
"""

from __future__ import annotations

import torch

from sluicegate.kernels.cpu_build import extension

__all__ = ["available", "linear", "pack"]


def available() -> bool:
    """Whether this CPU runs the product (builds the extension on first call)."""
    kernels = extension()
    return kernels is not None and bool(kernels.pair_linear_supported())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A bfloat16 weight [out, in] in panels of k pairs, for ``linear``."""
    kernels = extension()
    assert kernels is not None, "check sluicegate.kernels.cpu_pair_linear.available() first"
    return kernels.pack_pair_weight(weight.detach().contiguous())


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """``torch.nn.functional.linear(x, weight)`` for bfloat16 ``x`` of any leading shape and
    the weight ``pack`` packed, in bfloat16 (float32 sums)."""
    kernels = extension()
    assert kernels is not None
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = kernels.pair_linear(rows, packed, out_features)
    return out.view(*x.shape[:-1], out_features)

"""Linears on the CPU through the compiled packed-weight product (``csrc/linear/packed_linear.cpp``);
``torch.nn.functional.linear`` is its reference.

A decode step multiplies a few tens of rows by every weight of the model, so it streams all
the weights from memory once per step. oneDNN (the engine's other CPU path) leaves that
stream idle while it computes; this kernel keeps the weight in 16-column panels read
sequentially, six rows per register tile with AVX2 (twelve rows over two panels where the CPU
has AVX-512: ``isa()``), and prefetches the next panel while it works on the current one
(``bench/cpu_linear.py``). Part of the CPU kernels' extension (``sluicegate.kernels.cpu_build``);
``available()`` is False without a compiler or without AVX2 and FMA.

A bfloat16 or float16 weight is packed in its own dtype: half the bytes of float32 to stream
per step. The kernel widens it to float32 in registers and multiplies float32 rows of x
(16-bit inputs are widened first) with float32 accumulators, so its product is
``F.linear`` in float32 on the same weight values; the output is rounded back to x's dtype.
"""

from __future__ import annotations

import torch

from sluicegate.kernels.cpu_build import extension

__all__ = ["PackedWeight", "allow_avx512", "available", "isa", "linear", "pack"]


def available() -> bool:
    """Whether the packed product was built for this CPU (builds the extension on first call)."""
    kernels = extension()
    return kernels is not None and bool(kernels.packed_linear_supported())


def isa() -> str:
    """The vector instructions the product uses here: "avx512", "avx2" or "none"."""
    kernels = extension()
    return "none" if kernels is None else str(kernels.packed_linear_isa())


def allow_avx512(allow: bool) -> bool:
    """Whether the product may take its AVX-512 tiles where the CPU has them (on by default;
    tests and benches compare the two paths); returns the previous setting."""
    kernels = extension()
    assert kernels is not None, "check sluicegate.kernels.cpu_linear.available() first"
    return bool(kernels.packed_linear_allow_avx512(allow))


_HALF_DTYPES = (torch.bfloat16, torch.float16)


class PackedWeight:
    """A linear layer's weight ([out, in]) and bias, packed once for ``linear``: a float32,
    bfloat16 or float16 weight in its own dtype (others as float32), the bias as float32.

    ``gated``: the weight is a gated MLP's fused gate and up projections ([2I, in], gate rows
    first), and ``linear`` returns ``silu(gate) * up`` ([..., I]) instead of both halves.
    """

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False
    ) -> None:
        kernels = extension()
        assert kernels is not None, "check sluicegate.kernels.cpu_linear.available() first"
        self.rows, self.in_features = weight.shape
        self.gated = gated
        self.out_features = self.rows // 2 if gated else self.rows
        weight = weight.detach()
        if weight.dtype not in _HALF_DTYPES:
            weight = weight.float()
        self.dtype = weight.dtype
        self.panels = kernels.pack_linear_weight(weight.contiguous(), gated)
        self.bias = None if bias is None else bias.detach().float().contiguous()


def pack(
    weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False
) -> PackedWeight:
    return PackedWeight(weight, bias, gated)


def linear(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    """``torch.nn.functional.linear(x, weight, bias)`` for float32, bfloat16 or float16 ``x``
    of any leading shape, in x's dtype (for a gated weight, SiLU of its first half times its
    second)."""
    kernels = extension()
    assert kernels is not None
    rows = x.reshape(-1, weight.in_features)
    if x.dtype in _HALF_DTYPES:
        rows = rows.float()  # keeps a transposed view's strides
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = kernels.packed_linear(rows, weight.panels, weight.rows, weight.bias, weight.gated)
    return out.view(*x.shape[:-1], weight.out_features).to(x.dtype)

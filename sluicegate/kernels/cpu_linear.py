"""Float32 linears on the CPU through the compiled packed-weight product
(``csrc/packed_linear.cpp``); ``torch.nn.functional.linear`` is its reference.

A decode step multiplies a few tens of rows by every weight of the model, so it streams all
the weights from memory once per step. oneDNN (the engine's other CPU path) leaves that
stream idle while it computes; this kernel keeps the weight in 16-column panels read
sequentially, six rows per register tile with AVX2 (twelve rows over two panels where the CPU
has AVX-512: ``isa()``), and prefetches the next panel while it works on the current one
(``bench/cpu_linear.py``). Part of the CPU kernels' extension (``sluicegate.kernels.cpu_build``);
``available()`` is False without a compiler or without AVX2 and FMA.
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


class PackedWeight:
    """A linear layer's float32 weight ([out, in]) and bias, packed once for ``linear``.

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
        self.panels = kernels.pack_linear_weight(weight.detach().float().contiguous(), gated)
        self.bias = None if bias is None else bias.detach().float().contiguous()


def pack(
    weight: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False
) -> PackedWeight:
    return PackedWeight(weight, bias, gated)


def linear(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    """``torch.nn.functional.linear(x, weight, bias)`` for float32 ``x`` of any leading shape
    (for a gated weight, SiLU of its first half times its second)."""
    kernels = extension()
    assert kernels is not None
    rows = x.reshape(-1, weight.in_features)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = kernels.packed_linear(rows, weight.panels, weight.rows, weight.bias, weight.gated)
    return out.view(*x.shape[:-1], weight.out_features)

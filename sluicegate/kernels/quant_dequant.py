"""Quantized weight rows dequantized to float32 in one C++ pass (``csrc/linear/quant_dequant.cpp``):
the same arithmetic, bit for bit, as the torch code of
``sluicegate.engine.models.quant.linear.QuantizedLinear.dequantize``, which stays the path for
act-order checkpoints, other devices, a forward being compiled, and machines without the
extension. For a few activation rows (decode), ``linear_fp8`` / ``linear_int`` multiply as
they dequantize, a weight row at a time, so no dense weight goes to memory: float32 sums
of the same products, in another order than a GEMM's. ``bench/quantized_linear.py`` measures
them against torch."""

from __future__ import annotations

import torch

from sluicegate.kernels.cpu_build import extension

__all__ = ["dequantize_fp8", "dequantize_int", "linear_fp8", "linear_int", "supports"]


def supports(stored: torch.Tensor) -> bool:
    return (
        stored.device.type == "cpu"
        and not torch.compiler.is_compiling()
        and extension() is not None
    )


def dequantize_fp8(weight: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """e4m3 ``weight`` [rows, in] times ``scales`` [rows, groups], each over ``group`` columns."""
    kernels = extension()
    assert kernels is not None, "check supports() first"
    return kernels.dequantize_fp8(weight, scales.contiguous(), group)


def dequantize_int(
    codes: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    group: int,
    columns: int,
) -> torch.Tensor:
    """(code - zero) * scale for ``codes`` [rows, columns] (4-bit: two a byte, the even
    column low) with ``zeros`` and ``scales`` [rows, groups] over ``group`` columns each."""
    kernels = extension()
    assert kernels is not None, "check supports() first"
    return kernels.dequantize_int(
        codes, zeros.contiguous(), scales.contiguous(), bits, group, columns
    )


def linear_fp8(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, group: int
) -> torch.Tensor:
    """float32 ``x`` [tokens, in] @ ``dequantize_fp8(weight, scales, group)``^T."""
    kernels = extension()
    assert kernels is not None, "check supports() first"
    return kernels.linear_fp8(x.contiguous(), weight, scales.contiguous(), group)


def linear_int(
    x: torch.Tensor,
    codes: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    group: int,
) -> torch.Tensor:
    """float32 ``x`` [tokens, in] @ ``dequantize_int(codes, ...)``^T."""
    kernels = extension()
    assert kernels is not None, "check supports() first"
    return kernels.linear_int(
        x.contiguous(), codes, zeros.contiguous(), scales.contiguous(), bits, group, x.shape[1]
    )

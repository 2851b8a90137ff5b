"""Triton product of activations with a quantized weight, dequantized tile by tile on the way
into the dot: ``x @ W.T`` where ``W = (code - zero) * scale`` (int4/int8) or ``W = e4m3 * scale``
(fp8), in the storage of ``sluicegate.engine.models.quant.linear.QuantizedLinear`` (codes
uint8, two 4-bit codes a byte, low nibble first; zeros uint8 and float32 scales per row and
group of ``group`` input columns). The dense weight never exists in memory: each program reads
its [BLOCK_N, BLOCK_K] tile of codes (a half or a quarter of bf16's bytes), builds the weights
in registers, rounded to the activations' dtype as the torch path rounds its dequantized
weight (so 16-bit activations multiply on tensor cores), and accumulates in float32.

The definition is ``QuantizedLinear.dequantize`` (itself tested against
``sluicegate.kernels.quant_reference``); tests compare the two under the Triton interpreter.
e4m3 bytes are decoded by bit arithmetic (sign, exponent, mantissa) rather than by a float8
load, which the interpreter has no type for; act-order checkpoints (a group per input column,
permuted) keep the torch path.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["quant_linear"]


@triton.jit
def _e4m3_to_float(byte):
    """e4m3 (fn) bits to float32: bias 7, subnormals below exponent 1, no infinities."""
    bits = byte.to(tl.int32)
    sign = tl.where((bits & 0x80) != 0, -1.0, 1.0)
    exponent = (bits >> 3) & 0xF
    mantissa = (bits & 0x7).to(tl.float32)
    normal = tl.exp2((exponent - 7).to(tl.float32)) * (1.0 + mantissa / 8.0)
    subnormal = mantissa / 8.0 * 0.015625  # 2^-6
    return sign * tl.where(exponent == 0, subnormal, normal)


@triton.jit
def _quant_linear_kernel(
    x_ptr,
    codes_ptr,
    zeros_ptr,
    scales_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_codes,
    stride_groups,
    stride_om,
    GROUP: tl.constexpr,
    BITS: tl.constexpr,
    FP8: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    accumulator = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + rows[:, None] * stride_xm + ks[None, :],
            mask=(rows[:, None] < M) & (ks[None, :] < K),
            other=0.0,
        )
        inside = (cols[:, None] < N) & (ks[None, :] < K)
        if BITS == 4:
            packed = tl.load(
                codes_ptr + cols[:, None] * stride_codes + ks[None, :] // 2, mask=inside, other=0
            ).to(tl.int32)
            code = (packed >> ((ks[None, :] % 2) * 4)) & 15
        else:
            code = tl.load(
                codes_ptr + cols[:, None] * stride_codes + ks[None, :], mask=inside, other=0
            )
        groups = cols[:, None] * stride_groups + ks[None, :] // GROUP
        scale = tl.load(scales_ptr + groups, mask=inside, other=0.0)
        if FP8:
            weight = _e4m3_to_float(code) * scale
        else:
            zero = tl.load(zeros_ptr + groups, mask=inside, other=0).to(tl.float32)
            weight = (code.to(tl.float32) - zero) * scale
        weight = weight.to(x.dtype)
        if DOT_FP32:
            accumulator += tl.dot(
                x.to(tl.float32), tl.trans(weight.to(tl.float32)), input_precision="ieee"
            )
        else:
            accumulator += tl.dot(x, tl.trans(weight))
    tl.store(
        out_ptr + rows[:, None] * stride_om + cols[None, :],
        accumulator.to(out_ptr.dtype.element_ty),
        mask=(rows[:, None] < M) & (cols[None, :] < N),
    )


def quant_linear(
    x: torch.Tensor,
    codes: torch.Tensor,
    zeros: torch.Tensor | None,
    scales: torch.Tensor,
    bits: int,
    group: int,
) -> torch.Tensor:
    """``x`` [..., in] times the transposed quantized weight, in ``x``'s dtype. ``codes``:
    e4m3 weights [out, in] (``bits`` 8 with ``zeros`` None), or uint8 codes [out, in] (int8) /
    [out, in / 2] (int4) with their uint8 ``zeros`` [out, groups]; ``scales`` float32
    [out, groups]."""
    fp8 = zeros is None
    tokens = x.reshape(-1, x.shape[-1]).contiguous()
    m, k = tokens.shape
    n = codes.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.view(*x.shape[:-1], n)
    stored = codes.view(torch.uint8) if fp8 else codes
    scales = scales.contiguous()
    block_m = 16 if m <= 16 else 64
    block_n, block_k = 64, 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _quant_linear_kernel[grid](
        tokens,
        stored,
        scales if zeros is None else zeros.contiguous(),  # never read for fp8
        scales,
        out,
        m,
        n,
        k,
        tokens.stride(0),
        stored.stride(0),
        scales.stride(0),
        out.stride(0),
        GROUP=group,
        BITS=bits,
        FP8=fp8,
        # The interpreter has no 16-bit dot (numpy lacks bfloat16): it multiplies in float32.
        DOT_FP32=x.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1",
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out.view(*x.shape[:-1], n)

"""``quant_dequant``'s C++ pass against torch: every e4m3 bit pattern decodes to torch's own
float, and int codes (4-bit in both nibbles, 8-bit) minus zeros times scales agree bit for
bit, a short last group included. The quantized linears' tests hold it to each checkpoint
layout's reference."""

from __future__ import annotations

import pytest
import torch

from sluicegate.kernels import quant_dequant

pytestmark = pytest.mark.skipif(
    not quant_dequant.supports(torch.empty(0)), reason="the CPU kernels are not built here"
)


def test_every_e4m3_pattern_and_its_scale() -> None:
    weight = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(2, 128)
    scales = torch.tensor([[0.5, 3.0], [1e-3, 7.0]])
    got = quant_dequant.dequantize_fp8(weight, scales, 64)
    expected = weight.float() * scales.repeat_interleave(64, 1)
    assert torch.equal(got.isnan(), expected.isnan())  # 0x7f and 0xff
    assert torch.equal(got.nan_to_num(), expected.nan_to_num())


@pytest.mark.parametrize("bits", [4, 8])
def test_int_codes(bits: int) -> None:
    gen = torch.Generator().manual_seed(bits)
    rows, columns, group = 9, 200, 64  # four groups, the last of 8 columns
    codes = torch.randint(0, 1 << bits, (rows, columns), generator=gen)
    zeros = torch.randint(0, 1 << bits, (rows, 4), generator=gen, dtype=torch.uint8)
    scales = torch.rand(rows, 4, generator=gen)
    stored = codes.to(torch.uint8)
    if bits == 4:
        stored = stored[:, 0::2] | (stored[:, 1::2] << 4)
    got = quant_dequant.dequantize_int(stored, zeros, scales, bits, group, columns)
    per_column = torch.arange(columns) // group
    expected = (codes.float() - zeros.float()[:, per_column]) * scales[:, per_column]
    assert torch.equal(got, expected)


@pytest.mark.parametrize("tokens", [1, 3, 16])
def test_products_equal_dequantize_then_gemm(tokens: int) -> None:
    """linear_fp8 / linear_int: the float32 products of the same dequantized weights, summed in
    another order than a GEMM's."""
    gen = torch.Generator().manual_seed(tokens)
    rows, columns = 70, 320
    x = torch.randn(tokens, columns, generator=gen)
    weight = (torch.randn(rows, columns, generator=gen) * 40).to(torch.float8_e4m3fn)
    scales = torch.rand(rows, 3, generator=gen)  # blocks of 128 columns, the last of 64
    expected = x @ quant_dequant.dequantize_fp8(weight, scales, 128).T
    got = quant_dequant.linear_fp8(x, weight, scales, 128)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-3)
    codes = torch.randint(0, 256, (rows, columns // 2), generator=gen, dtype=torch.uint8)
    zeros = torch.randint(0, 16, (rows, 5), generator=gen, dtype=torch.uint8)
    scales = torch.rand(rows, 5, generator=gen)
    dense = quant_dequant.dequantize_int(codes, zeros, scales, 4, 64, columns)
    got = quant_dequant.linear_int(x, codes, zeros, scales, 4, 64)
    torch.testing.assert_close(got, x @ dense.T, rtol=1e-5, atol=1e-3)

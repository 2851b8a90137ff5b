"""The bfloat16 dot-product linear against its reference, ``torch.nn.functional.linear`` in
float64 on the same bfloat16 values: the kernel's float32 sums rounded once to bfloat16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sluicegate.kernels import cpu_pair_linear

pytestmark = pytest.mark.skipif(
    not cpu_pair_linear.available(),
    reason="the bfloat16 dot-product linear needs a C++ compiler and AVX512_BF16",
)

# One rounding to bfloat16 off the float64 product (float32 sums of K products lie far
# inside it).
ROUNDED = {"atol": 1e-3, "rtol": 8e-3}


@pytest.mark.parametrize(
    "rows,in_features,out_features",
    [
        (1, 576, 960),  # a decode step of one request: SmolLM2's q/k/v product
        (6, 64, 64),  # one whole tile: six rows by four panels
        (13, 64, 112),  # seven panels: a unit of four, one of three; uneven tiles of rows
        (30, 576, 3072),
        (7, 577, 50),  # an odd K (its last pair half zero); N ends mid-panel
        (5, 31, 17),  # a unit of two panels, the second with one real column
        (241, 96, 80),  # more rows than a block: two blocks of rows
        (500, 1536, 576),
    ],
)
def test_matches_float64_reference(rows: int, in_features: int, out_features: int) -> None:
    generator = torch.Generator().manual_seed(rows * 7 + in_features)
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    weight = torch.randn(out_features, in_features, generator=generator).bfloat16()
    out = cpu_pair_linear.linear(x, cpu_pair_linear.pack(weight), out_features)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    expected = F.linear(x.double(), weight.double())
    torch.testing.assert_close(out.double(), expected, **ROUNDED)


def test_leading_dimensions_and_strided_rows() -> None:
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 48, generator=generator).bfloat16()
    packed = cpu_pair_linear.pack(weight)
    fused = torch.randn(2, 3, 80, generator=generator).bfloat16()
    x = fused[..., :48]  # rows 80 apart, as a view into a wider product
    out = cpu_pair_linear.linear(x, packed, 64)
    assert out.shape == (2, 3, 64)
    torch.testing.assert_close(out, cpu_pair_linear.linear(x.contiguous(), packed, 64))
    torch.testing.assert_close(out.double(), F.linear(x.double(), weight.double()), **ROUNDED)


def test_bad_inputs_are_refused() -> None:
    weight = torch.randn(32, 16).bfloat16()
    packed = cpu_pair_linear.pack(weight)
    with pytest.raises(RuntimeError, match="bfloat16"):
        cpu_pair_linear.linear(torch.randn(2, 16), packed, 32)
    with pytest.raises(RuntimeError, match="columns"):
        cpu_pair_linear.linear(torch.randn(2, 18).bfloat16(), packed, 32)
    with pytest.raises(RuntimeError, match="N disagrees"):
        cpu_pair_linear.linear(torch.randn(2, 16).bfloat16(), packed, 64)
    with pytest.raises(RuntimeError, match="bfloat16 CPU weight"):
        cpu_pair_linear.pack(torch.randn(32, 16))

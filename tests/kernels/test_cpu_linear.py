"""The compiled packed-weight linear against its reference, ``torch.nn.functional.linear``
(in float64, so the check does not lean on either float32 summation order), for float32,
bfloat16 and float16 weights: a 16-bit weight's reference is F.linear on its values widened,
which is what the kernel computes in float32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sluicegate.kernels import cpu_linear

pytestmark = pytest.mark.skipif(
    not cpu_linear.available(), reason="the packed linear needs a C++ compiler, AVX2 and FMA"
)


DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# float32 sums of K products: error grows like sqrt(K) ulps of the terms.
FLOAT32 = {"atol": 1e-4, "rtol": 1e-4}
# An output rounded to a 16-bit x's dtype: one rounding off the float64 product.
ROUNDED = {
    torch.float32: FLOAT32,
    torch.bfloat16: {"atol": 1e-4, "rtol": 8e-3},
    torch.float16: {"atol": 1e-4, "rtol": 1e-3},
}


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    packed = cpu_linear.pack(weight, bias)
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    out = cpu_linear.linear(x, packed)
    assert out.dtype == torch.float32 and out.shape == expected.shape
    torch.testing.assert_close(out.double(), expected, **FLOAT32)
    if weight.dtype != torch.float32:
        # The model's case: x in the weight's dtype, the output rounded back to it.
        narrow = x.to(weight.dtype)
        expected = F.linear(
            narrow.double(), weight.double(), None if bias is None else bias.double()
        )
        out = cpu_linear.linear(narrow, packed)
        assert out.dtype == weight.dtype
        torch.testing.assert_close(out.double(), expected, **ROUNDED[weight.dtype])


def _weight(
    *shape: int, generator: torch.Generator, scale: float, dtype: torch.dtype
) -> torch.Tensor:
    return (torch.randn(*shape, generator=generator) * scale).to(dtype)


# Every row count a register tile can end on (1-6, then more tiles), the decode sizes, and
# row counts past one block of rows (several blocks, split across threads).
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 13, 22, 64, 300, 1030])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows(rows: int, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 256, generator=generator)
    weight = _weight(96, 256, generator=generator, scale=1 / 16, dtype=dtype)
    _check(x, weight, None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_16_bit_weight_stays_16_bit(dtype: torch.dtype) -> None:
    # Half the bytes to stream per step: the panels keep the weight's dtype, not float32.
    weight = torch.randn(40, 24).to(dtype)
    packed = cpu_linear.pack(weight)
    assert packed.panels.dtype == dtype and packed.panels.shape == (3, 24, 16)
    assert torch.equal(packed.panels[0, :, :16].t(), weight[:16])
    assert torch.equal(packed.panels[2, :, :8].t(), weight[32:])
    assert not packed.panels[2, :, 8:].any()  # columns past the weight's rows are zero


# Output widths that fill panels exactly, leave a partial last panel, or are one panel
# short; input widths odd, tiny and large (a block of rows shrinks to fit them in L2).
@pytest.mark.parametrize(
    ("out_features", "in_features"), [(16, 64), (17, 33), (1, 7), (250, 5), (40, 4100)]
)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_shapes_and_bias(
    out_features: int, in_features: int, with_bias: bool, dtype: torch.dtype
) -> None:
    generator = torch.Generator().manual_seed(out_features * in_features)
    x = torch.randn(9, in_features, generator=generator)
    weight = _weight(
        out_features, in_features, generator=generator, scale=in_features**-0.5, dtype=dtype
    )
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    _check(x, weight, bias)


def test_leading_dimensions_and_strided_rows() -> None:
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(48, 32, generator=generator)
    packed = cpu_linear.pack(weight)
    x = torch.randn(2, 3, 32, generator=generator)
    torch.testing.assert_close(cpu_linear.linear(x, packed), F.linear(x, weight))
    wide = torch.randn(5, 64, generator=generator)
    rows = wide[:, :32]  # rows 64 floats apart
    torch.testing.assert_close(cpu_linear.linear(rows, packed), F.linear(rows, weight))
    columns = torch.randn(32, 5, generator=generator).t()  # no unit stride along a row
    torch.testing.assert_close(cpu_linear.linear(columns, packed), F.linear(columns, weight))
    # The same for 16-bit rows, widened before the product (a widened transposed view keeps
    # its strides).
    narrow = cpu_linear.pack(weight.bfloat16())
    for x in (wide[:, :32].bfloat16(), columns.bfloat16()):
        expected = F.linear(x.float(), weight.bfloat16().float()).bfloat16()
        torch.testing.assert_close(cpu_linear.linear(x, narrow), expected)


def test_no_rows() -> None:
    packed = cpu_linear.pack(torch.randn(20, 8))
    assert cpu_linear.linear(torch.randn(0, 8), packed).shape == (0, 20)


def test_threads_split_the_same_result() -> None:
    # One thread or two: each output element's sum is the same sequence of operations.
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(30, 128, generator=generator)
    packed = cpu_linear.pack(torch.randn(200, 128, generator=generator))
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = cpu_linear.linear(x, packed)
        torch.set_num_threads(2)
        assert torch.equal(cpu_linear.linear(x, packed), single)
    finally:
        torch.set_num_threads(previous)


def test_refuses_what_it_cannot_compute() -> None:
    packed = cpu_linear.pack(torch.randn(20, 8))
    with pytest.raises(RuntimeError, match="invalid for input"):
        cpu_linear.linear(torch.randn(3, 9), packed)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_linear.linear(torch.randn(3, 8, dtype=torch.float64), packed)


@pytest.mark.parametrize(("intermediate", "rows"), [(1408, 22), (37, 9), (16, 1), (50, 300)])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gated_weight_returns_silu_of_gate_times_up(
    intermediate: int, rows: int, with_bias: bool, dtype: torch.dtype
) -> None:
    # A gated MLP's fused [gate; up] weight: the product is silu(x W_gate^T) * (x W_up^T).
    generator = torch.Generator().manual_seed(intermediate + rows)
    in_features = 48
    weight = _weight(
        2 * intermediate, in_features, generator=generator, scale=in_features**-0.5, dtype=dtype
    )
    bias = torch.randn(2 * intermediate, generator=generator) if with_bias else None
    x = torch.randn(rows, in_features, generator=generator)
    both = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    expected = F.silu(both[:, :intermediate]) * both[:, intermediate:]
    packed = cpu_linear.pack(weight, bias, gated=True)
    out = cpu_linear.linear(x, packed)
    assert out.shape == (rows, intermediate)
    torch.testing.assert_close(out.double(), expected, **FLOAT32)
    if dtype != torch.float32:
        out = cpu_linear.linear(x.to(dtype), packed)
        both = F.linear(
            x.to(dtype).double(), weight.double(), None if bias is None else bias.double()
        )
        expected = F.silu(both[:, :intermediate]) * both[:, intermediate:]
        assert out.dtype == dtype
        torch.testing.assert_close(out.double(), expected, **ROUNDED[dtype])


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_avx512_and_avx2_tiles_give_the_same_bits(gated: bool, dtype: torch.dtype) -> None:
    # Each output is the same sequence of fused multiply-adds over k in both tile shapes.
    if cpu_linear.isa() != "avx512":
        pytest.skip("this CPU has no AVX-512: the AVX2 tiles are the only ones")
    generator = torch.Generator().manual_seed(29)
    weight = _weight(2 * 70, 200, generator=generator, scale=1 / 14, dtype=dtype)
    bias = torch.randn(2 * 70, generator=generator)
    packed = cpu_linear.pack(weight, bias, gated=gated)
    for rows in (1, 5, 6, 7, 12, 13, 30, 500):
        x = torch.randn(rows, 200, generator=generator)
        wide = cpu_linear.linear(x, packed)
        previous = cpu_linear.allow_avx512(False)
        try:
            assert cpu_linear.isa() == "avx2"
            narrow = cpu_linear.linear(x, packed)
        finally:
            cpu_linear.allow_avx512(previous)
        assert torch.equal(wide, narrow), rows

"""The Triton quantized product against ``QuantizedLinear.dequantize`` (the definition) times
the activations, for fp8, int8 and int4 storage, several group sizes and activation dtypes
(Triton interpreter on the CPU, or a GPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sluicegate.engine.models.quant.linear import QuantizedLinear
from sluicegate.engine.models.quant.scheme import QuantScheme
from sluicegate.kernels.triton_quant_linear import quant_linear

SCHEMES = {
    "fp8": QuantScheme("compressed-tensors", "fp8", 8),
    "int8": QuantScheme("compressed-tensors", "pack-quantized", 8, group_size=32),
    "int4": QuantScheme("compressed-tensors", "pack-quantized", 4, group_size=16),
    "int4-channel": QuantScheme("compressed-tensors", "pack-quantized", 4),
}
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def filled(name: str, in_features: int, out_features: int) -> QuantizedLinear:
    """A linear in the engine's storage with random codes, zero points and scales."""
    generator = torch.Generator().manual_seed(in_features * out_features)
    linear = QuantizedLinear(SCHEMES[name], in_features, out_features)
    with torch.no_grad():
        if name == "fp8":
            weight = torch.randn(out_features, in_features, generator=generator) * 40
            linear.weight.copy_(weight.to(torch.float8_e4m3fn))
        else:
            linear.codes.copy_(torch.randint(0, 256, linear.codes.shape, generator=generator))
            top = 256 if linear.scheme.bits == 8 else 16
            linear.zeros.copy_(torch.randint(0, top, linear.zeros.shape, generator=generator))
        linear.scales.copy_(torch.rand(linear.scales.shape, generator=generator) * 0.02)
    return linear


@pytest.mark.parametrize("name", list(SCHEMES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("rows", "in_features", "out_features"), [(1, 64, 96), (19, 96, 70)])
def test_the_product_equals_the_dequantized_weights(
    name: str, dtype: torch.dtype, rows: int, in_features: int, out_features: int
) -> None:
    linear = filled(name, in_features, out_features)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows)).to(dtype)
    # The torch path's own rounding: the dequantized weight in the activations' dtype.
    want = F.linear(x.float(), linear.dequantize().to(dtype).float())
    zeros = None if name == "fp8" else linear.zeros
    codes = linear.weight if name == "fp8" else linear.codes
    ours = quant_linear(x, codes, zeros, linear.scales, linear.scheme.bits, linear.group)
    assert ours.dtype == dtype
    scale = want.abs().max().item()
    torch.testing.assert_close(ours.float(), want, rtol=0, atol=TOLERANCE[dtype] * scale)


def test_e4m3_decoding_covers_subnormals_and_the_largest_values() -> None:
    values = torch.tensor([0.0, 2.0**-9, 2.0**-7, 0.1, 1.0, -3.5, 240.0, 448.0, -448.0])
    weight = values.to(torch.float8_e4m3fn)[:, None].expand(-1, 32).contiguous()
    scales = torch.ones(len(values), 1)
    x = torch.zeros(1, 32)
    x[0, 0] = 1.0
    out = quant_linear(x, weight, None, scales, 8, 32)
    assert out[0].tolist() == weight[:, 0].float().tolist()

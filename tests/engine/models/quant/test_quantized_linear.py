"""``QuantizedLinear`` on its own, through the C++ dequantization and through torch's: groups
and fp8 blocks that do not tile a row (torch's expanded path) dequantize exactly as the
reference, and the forward (multiplying as it dequantizes for a few rows; taken a block of
weight rows at a time for many) is the product with the reference weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sluicegate.engine.models.quant import linear as quant_linear
from sluicegate.engine.models.quant.linear import QuantizedLinear
from sluicegate.engine.models.quant.scheme import QuantScheme
from sluicegate.kernels import quant_dequant
from sluicegate.kernels import quant_reference as ref

OUT, IN = 40, 256


def _pack_quantized(bits: int, group: int) -> tuple[QuantizedLinear, torch.Tensor]:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    gen = torch.Generator().manual_seed(bits)
    half = 1 << (bits - 1)
    codes = torch.randint(-half, half, (OUT, IN), generator=gen, dtype=torch.int8)
    zeros = torch.randint(-half, half, (OUT, -(-IN // group)), generator=gen, dtype=torch.int8)
    tensors = {
        "weight_packed": pack_to_int32(codes, bits),
        "weight_scale": torch.rand(zeros.shape, generator=gen).to(torch.bfloat16),
        "weight_shape": torch.tensor([OUT, IN]),
        "weight_zero_point": pack_to_int32(zeros, bits, packed_dim=0),
    }
    scheme = QuantScheme("compressed-tensors", "pack-quantized", bits, group, symmetric=False)
    layer = QuantizedLinear(scheme, IN, OUT)
    layer.load(tensors)
    expected = ref.dequantize_pack_quantized(
        tensors["weight_packed"],
        tensors["weight_scale"],
        tensors["weight_shape"],
        bits,
        group,
        tensors["weight_zero_point"],
    )
    return layer, expected


def _fp8_blocks(block: tuple[int, int]) -> tuple[QuantizedLinear, torch.Tensor]:
    gen = torch.Generator().manual_seed(9)
    weight = (torch.randn(OUT, IN, generator=gen) * 30).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-OUT // block[0]), -(-IN // block[1]), generator=gen)
    scheme = QuantScheme("fp8", "fp8", 8, block=block, fp8_scale="weight_scale_inv")
    layer = QuantizedLinear(scheme, IN, OUT)
    layer.load({"weight": weight, "weight_scale_inv": scale})
    return layer, ref.dequantize_fp8(weight, scale, block)


@pytest.mark.parametrize(
    "make",
    [
        lambda: _pack_quantized(4, 96),  # 256 inputs: groups of 96, 96 and 64
        lambda: _pack_quantized(8, 64),
        lambda: _fp8_blocks((16, 96)),
        lambda: _fp8_blocks((128, 128)),
    ],
)
@pytest.mark.parametrize("compiled", [True, False])
def test_dequantize_and_blocked_forward(
    make, compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not compiled:
        monkeypatch.setattr(quant_dequant, "supports", lambda _: False)
    layer, expected = make()
    assert torch.equal(layer.dequantize(), expected)
    assert torch.equal(layer.dequantize(7, 33), expected[7:33])
    # A decode step's few rows (the CPU kernel's product, where it runs) and a prefill's.
    for rows in (1, 5, quant_linear._FUSED_ROWS + 4):
        x = torch.randn(rows, IN)
        reference = F.linear(x, expected)
        # Sums of ~1e3 in float32, in another order: an error of a few 1e-7 of the largest.
        atol = 1e-6 * float(reference.abs().max())
        torch.testing.assert_close(layer(x), reference, rtol=1e-5, atol=atol)
    # 3 rows' worth of weights a block: 14 blocks, the last one short.
    monkeypatch.setattr(quant_linear, "_BLOCK_ELEMENTS", 3 * IN)
    x = torch.randn(quant_linear._FUSED_ROWS + 4, IN)
    blocks = [F.linear(x, expected[r : r + 3]) for r in range(0, OUT, 3)]
    assert torch.equal(layer(x), torch.cat(blocks, -1))

"""``quant_reference``: each layout's dequantization against codes, zero points and scales
known in advance, packed independently (compressed-tensors' own packer; AutoAWQ's and
AutoGPTQ's packing loops, word by word in plain Python), and the fp8 activation rounding
against compressed-tensors' own QDQ."""

from __future__ import annotations

import pytest
import torch

from sluicegate.kernels import quant_reference as ref

OUT, IN, GROUP = 24, 256, 128


def _signed_int32(word: int) -> int:
    return word - (1 << 32) if word >= 1 << 31 else word


def _expected(
    codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_of: torch.Tensor
) -> torch.Tensor:
    """[out, in] from codes [out, in] and per-group zeros/scales [out, groups]."""
    return (codes.float() - zeros.float()[:, group_of]) * scales.float()[:, group_of]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [GROUP, 96, None])
@pytest.mark.parametrize("symmetric", [True, False])
def test_pack_quantized(bits: int, group_size: int | None, symmetric: bool) -> None:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    gen = torch.Generator().manual_seed(bits)
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    codes = torch.randint(low, high + 1, (OUT, IN), generator=gen, dtype=torch.int8)
    groups = -(-IN // (group_size or IN))  # 96 leaves a short last group, as CT allows
    scales = torch.rand(OUT, groups, generator=gen).to(torch.bfloat16) + 0.01
    zeros = torch.zeros(OUT, groups, dtype=torch.int8)
    if not symmetric:
        zeros = torch.randint(low, high + 1, (OUT, groups), generator=gen, dtype=torch.int8)
    got = ref.dequantize_pack_quantized(
        pack_to_int32(codes, bits),
        scales,
        torch.tensor([OUT, IN]),
        bits,
        group_size,
        None if symmetric else pack_to_int32(zeros, bits, packed_dim=0),
    )
    group_of = torch.arange(IN) // (group_size or IN)
    assert torch.equal(got, _expected(codes, zeros, scales, group_of))


@pytest.mark.parametrize("block", [None, (128, 128), (16, 96)])
def test_fp8(block: tuple[int, int] | None) -> None:
    gen = torch.Generator().manual_seed(3)
    weight = (torch.randn(OUT, IN, generator=gen) * 50).to(torch.float8_e4m3fn)
    if block is None:
        scale = torch.rand(OUT, 1, generator=gen)
        expected = weight.float() * scale
    else:
        scale = torch.rand(-(-OUT // block[0]), -(-IN // block[1]), generator=gen)
        expected = weight.float().clone()
        for r in range(OUT):
            for c in range(IN):
                expected[r, c] *= scale[r // block[0], c // block[1]]
    assert torch.equal(ref.dequantize_fp8(weight, scale, block), expected)
    one = torch.tensor(0.25)
    assert torch.equal(ref.dequantize_fp8(weight, one), weight.float() * 0.25)


def _awq_pack(values: list[list[int]]) -> torch.Tensor:
    """AutoAWQ's WQLinear_GEMM.from_linear: word c of a row holds columns 8c + order[i] in
    nibble i."""
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    rows = []
    for row in values:
        words = []
        for c in range(len(row) // 8):
            word = 0
            for i in range(8):
                word |= row[8 * c + order[i]] << (4 * i)
            words.append(_signed_int32(word))
        rows.append(words)
    return torch.tensor(rows, dtype=torch.int32)


def test_awq() -> None:
    gen = torch.Generator().manual_seed(4)
    codes = torch.randint(0, 16, (IN, OUT), generator=gen)  # AWQ's [in, out]
    zeros = torch.randint(0, 16, (IN // GROUP, OUT), generator=gen)
    scales = (torch.rand(IN // GROUP, OUT, generator=gen) + 0.01).half()
    got = ref.dequantize_awq(_awq_pack(codes.tolist()), _awq_pack(zeros.tolist()), scales, GROUP)
    group_of = torch.arange(IN) // GROUP
    assert torch.equal(got, _expected(codes.T, zeros.T, scales.T, group_of))


def _gptq_pack_rows(values: list[list[int]], bits: int) -> torch.Tensor:
    """AutoGPTQ's QuantLinear.pack: word row r holds rows r*k .. r*k+k-1 (k = 32/bits),
    the first in the lowest bits."""
    per_word = 32 // bits
    packed = []
    for r in range(len(values) // per_word):
        packed.append(
            [
                _signed_int32(
                    sum(values[r * per_word + j][c] << (bits * j) for j in range(per_word))
                )
                for c in range(len(values[0]))
            ]
        )
    return torch.tensor(packed, dtype=torch.int32)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("zero_offset", [1, 0])
def test_gptq(bits: int, act_order: bool, zero_offset: int) -> None:
    gen = torch.Generator().manual_seed(5)
    top = (1 << bits) - 1
    codes = torch.randint(0, top + 1, (IN, OUT), generator=gen)
    groups = IN // GROUP
    # Stored zeros stay below the top, so that the "gptq" format's +1 stays in range.
    stored_zeros = torch.randint(0, top, (groups, OUT), generator=gen)
    scales = (torch.rand(groups, OUT, generator=gen) + 0.01).half()
    order = torch.randperm(IN, generator=gen) if act_order else torch.arange(IN)
    g_idx = torch.empty(IN, dtype=torch.int32)
    g_idx[order] = (torch.arange(IN) // GROUP).to(torch.int32)
    qweight = _gptq_pack_rows(codes.tolist(), bits)
    qzeros = _gptq_pack_rows(stored_zeros.T.tolist(), bits).T
    got = ref.dequantize_gptq(qweight, qzeros, scales, g_idx, bits, zero_offset)
    expected = _expected(codes.T, stored_zeros.T + zero_offset, scales.T, g_idx.long())
    assert torch.equal(got, expected)


@pytest.mark.parametrize("group", [None, 64])
def test_fp8_activations_match_compressed_tensors(group: int | None) -> None:
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    x = torch.randn(7, IN, generator=torch.Generator().manual_seed(6)) * 3
    x[2] = 0  # an all-zero token row
    strategy = {"strategy": "group", "group_size": group} if group else {"strategy": "token"}
    args = QuantizationArgs(num_bits=8, type="float", symmetric=True, dynamic=True, **strategy)
    view = x.unflatten(-1, (-1, group)) if group else x
    scale, zero = calculate_qparams(view.amin(-1), view.amax(-1), args)
    if not group:
        scale, zero = scale.unsqueeze(-1), zero.unsqueeze(-1)
    expected = fake_quantize(x, scale, zero, args)
    assert torch.equal(ref.fake_quantize_fp8(x, group), expected)

"""One linear's checkpoint tensors, in whichever layout, repacked once at load into the
storage ``QuantizedLinear`` keeps: rows are output features, columns input features.

  fp8:  weight e4m3 [out, in]; scales float32 [out, in / group] (group: the block's width,
        or all of a row)
  int:  codes uint8 [out, in / 2] (4-bit: two a byte, the even column in the low nibble) or
        [out, in] (8-bit), unsigned; zeros uint8 and scales float32 [out, groups]; g_idx
        [in] where act-order permutes the groups

The unpacking is ``sluicegate.kernels.quant_reference``'s, so the layouts have one definition.
"""

from __future__ import annotations

import torch

from sluicegate.engine.models.quant.scheme import QuantScheme, UnsupportedQuantizationError
from sluicegate.kernels import quant_reference as ref

Tensors = dict[str, torch.Tensor]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    codes = codes.to(torch.uint8)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def _store_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    return pack_nibbles(codes) if bits == 4 else codes.to(torch.uint8)


def repack(scheme: QuantScheme, tensors: Tensors, out: int, inputs: int) -> Tensors:
    """Storage for a [out, inputs] linear from its checkpoint ``tensors`` (named as in the
    checkpoint, without the module prefix)."""
    if scheme.is_fp8:
        return _fp8(scheme, tensors, out)
    if scheme.layout == "pack-quantized":
        return _pack_quantized(scheme, tensors, out, inputs)
    if scheme.layout == "awq":
        return _awq(tensors, out)
    return _gptq(scheme, tensors, out, inputs)


def _fp8(scheme: QuantScheme, tensors: Tensors, out: int) -> Tensors:
    weight = tensors["weight"]
    if weight.dtype != torch.float8_e4m3fn:
        raise UnsupportedQuantizationError(f"fp8 weight of dtype {weight.dtype} (only e4m3)")
    scale = tensors[scheme.fp8_scale].float()
    if scheme.block is None:
        scale = scale.reshape(-1, 1)
        scale = scale.expand(out, 1) if scale.shape[0] == 1 else scale
    else:
        # A block's scale repeated down its rows: the columns stay blocked.
        scale = scale.repeat_interleave(scheme.block[0], 0)[:out]
    return {"weight": weight, "scales": scale.contiguous()}


def _pack_quantized(scheme: QuantScheme, tensors: Tensors, out: int, inputs: int) -> Tensors:
    shape = tuple(int(v) for v in tensors["weight_shape"].tolist())
    if shape != (out, inputs):
        raise ValueError(f"weight_shape {shape} != the model's {(out, inputs)}")
    bits = scheme.bits
    codes = ref.unpack_int32(tensors["weight_packed"], bits, inputs, dim=1)
    scales = tensors["weight_scale"].float()
    if "weight_zero_point" in tensors:
        zeros = ref.unpack_int32(tensors["weight_zero_point"], bits, out, dim=0)
    else:
        # Signed codes are stored offset by half the range, so zero sits there.
        zeros = torch.full(scales.shape, 1 << (bits - 1))
    return {
        "codes": _store_codes(codes, bits),
        "zeros": zeros.to(torch.uint8),
        "scales": scales,
    }


def _awq(tensors: Tensors, out: int) -> Tensors:
    return {
        "codes": pack_nibbles(ref.unpack_awq(tensors["qweight"], out).T),
        "zeros": ref.unpack_awq(tensors["qzeros"], out).T.to(torch.uint8).contiguous(),
        "scales": tensors["scales"].float().T.contiguous(),
    }


def _gptq(scheme: QuantScheme, tensors: Tensors, out: int, inputs: int) -> Tensors:
    bits = scheme.bits
    codes = ref.unpack_int32(tensors["qweight"], bits, inputs, dim=0).T
    zeros = ref.unpack_int32(tensors["qzeros"], bits, out, dim=1) + scheme.zero_offset
    g_idx = tensors["g_idx"].long()
    stored = {
        "codes": _store_codes(codes, bits),
        "zeros": zeros.T.to(torch.uint8).contiguous(),
        "scales": tensors["scales"].float().T.contiguous(),
    }
    if scheme.act_order:
        stored["g_idx"] = g_idx
    elif not torch.equal(g_idx, torch.arange(inputs) // (scheme.group_size or inputs)):
        raise ValueError("g_idx permutes the groups, but the config says desc_act false")
    return stored

"""Plain-torch definitions of quantized checkpoints' weights: each function takes a linear's
tensors exactly as its checkpoint stores them and returns the float32 weight [out, in] they
stand for, which is what a quantized linear multiplies by.

These are the single definition of each layout: the engine's quantized linears
(``sluicegate.engine.models.quant``) repack the tensors once at load and are tested to give
these weights bit for bit. All arithmetic is float32 (integer codes and bf16/fp16 scales
convert to float32 exactly), so the order of operations is the only thing to agree on:
``(code - zero) * scale``.

Layouts (``g``: group size along the input dimension, ``b``: bits per code):
  fp8 (compressed-tensors float-quantized, HF/vLLM ``fp8``): weight e4m3 [out, in]; scale
      [1] (tensor), [out, 1] (channel) or [ceil(out/bo), ceil(in/bi)] (blocks of bo x bi;
      HF calls it ``weight_scale_inv`` though it multiplies).
  pack-quantized (compressed-tensors): codes signed, stored plus 2^(b-1), densely packed in
      int32 along the input dim (code i at bit i*b of the row); ``weight_zero_point`` signed,
      packed the same way along the output dim; scale [out, in/g].
  AWQ GEMM (AutoAWQ): qweight int32 [in, out/8], eight 4-bit codes a word in the order
      0, 2, 4, 6, 1, 3, 5, 7 of their output columns; qzeros likewise [in/g, out/8]; scales
      fp16 [in/g, out].
  GPTQ (AutoGPTQ): qweight int32 [in*b/32, out] packed along the input dim; qzeros int32
      [groups, out*b/32] packed along the output dim, stored minus one (checkpoint_format
      ``gptq``; ``gptq_v2`` stores them as they are); scales [groups, out]; g_idx [in] the
      group of each input (act-order permutes it).
"""

from __future__ import annotations

import torch

__all__ = [
    "AWQ_ORDER",
    "dequantize_awq",
    "dequantize_fp8",
    "dequantize_gptq",
    "dequantize_pack_quantized",
    "fake_quantize_fp8",
    "unpack_awq",
    "unpack_int32",
]

# The output column each nibble of an AWQ word holds, nibble 0 (lowest bits) first.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_int32(packed: torch.Tensor, bits: int, count: int, dim: int) -> torch.Tensor:
    """Unsigned ``bits``-bit codes (int32) packed densely along ``dim`` of ``packed``: code i of
    a row at bit i*bits of the row's words; the first ``count`` codes."""
    if 32 % bits:
        raise ValueError(f"{bits}-bit codes do not tile an int32 word")
    per_word = 32 // bits
    words = packed.to(torch.int32).movedim(dim, -1)
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    codes = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    codes = codes.flatten(-2)[..., :count]
    assert codes.shape[-1] == count, f"{count} codes asked of {words.shape[-1] * per_word}"
    return codes.movedim(-1, dim)


def _expand(scale: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """A grid of scales stretched over a weight of ``shape``, each entry over its ``block``
    (the last blocks of a row or column may be cut short)."""
    grid = scale.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return grid[: shape[0], : shape[1]]


def dequantize_fp8(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None
) -> torch.Tensor:
    """An e4m3 weight [out, in] times its scale: one scale (per tensor), one a row [out, 1]
    (per channel) or one per ``block`` of weights (rows, columns)."""
    rows, cols = weight.shape
    if block is None:
        block = (1, cols) if scale.numel() > 1 else (rows, cols)
    return weight.float() * _expand(
        scale.reshape(-1, 1) if scale.dim() < 2 else scale, block, (rows, cols)
    )


def dequantize_pack_quantized(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_shape: torch.Tensor,
    bits: int,
    group_size: int | None,
    weight_zero_point: torch.Tensor | None = None,
) -> torch.Tensor:
    """compressed-tensors ``pack-quantized``; ``group_size`` None: per channel."""
    rows, cols = (int(v) for v in weight_shape.tolist())
    block = (1, group_size or cols)
    offset = 1 << (bits - 1)
    codes = unpack_int32(weight_packed, bits, cols, dim=1).float() - offset
    if weight_zero_point is None:
        return codes * _expand(weight_scale, block, (rows, cols))
    zero = unpack_int32(weight_zero_point, bits, rows, dim=0).float() - offset
    return (codes - _expand(zero, block, (rows, cols))) * _expand(weight_scale, block, (rows, cols))


def unpack_awq(packed: torch.Tensor, columns: int) -> torch.Tensor:
    """AutoAWQ's 4-bit codes [rows, columns] from their int32 words [rows, columns / 8]."""
    nibbles = unpack_int32(packed, 4, packed.shape[1] * 8, dim=1).unflatten(1, (-1, 8))
    # Nibble k of word j is column 8j + AWQ_ORDER[k]; invert that to read columns in order.
    column_of_nibble = torch.argsort(torch.tensor(AWQ_ORDER))
    return nibbles[:, :, column_of_nibble].flatten(1)[:, :columns]


def dequantize_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int
) -> torch.Tensor:
    """AutoAWQ's GEMM layout (4-bit codes); returns [out, in]."""
    inputs, out = qweight.shape[0], scales.shape[1]
    codes, zeros = unpack_awq(qweight, out).float(), unpack_awq(qzeros, out).float()
    group = torch.arange(inputs) // group_size
    return ((codes - zeros[group]) * scales.float()[group]).T


def dequantize_gptq(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    bits: int,
    zero_offset: int = 1,
) -> torch.Tensor:
    """AutoGPTQ's layout, act-order or not (``g_idx`` says each input's group); returns
    [out, in]. ``zero_offset``: what the stored zeros lack (1 in the ``gptq`` format)."""
    inputs, out = g_idx.shape[0], scales.shape[1]
    codes = unpack_int32(qweight, bits, inputs, dim=0).float()
    zeros = unpack_int32(qzeros, bits, out, dim=1).float() + zero_offset
    group = g_idx.long()
    return ((codes - zeros[group]) * scales.float()[group]).T


def fake_quantize_fp8(x: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """Activations as a dynamic fp8 scheme sees them: each token's row (or each ``group`` of
    its columns) scaled by its absolute maximum onto e4m3's range, rounded to e4m3 and
    scaled back, in ``x``'s dtype (compressed-tensors' per-token QDQ)."""
    finfo = torch.finfo(torch.float8_e4m3fn)
    shape = x.shape
    if group is not None:
        x = x.unflatten(-1, (-1, group))
    scale = x.abs().amax(-1, keepdim=True) / finfo.max
    # An all-zero row keeps a tiny scale, so it stays zero instead of dividing by zero.
    scale = torch.where(scale == 0, torch.finfo(x.dtype).eps, scale)
    quantized = (x / scale).clamp(finfo.min, finfo.max).to(torch.float8_e4m3fn)
    return (quantized.to(x.dtype) * scale).reshape(shape)

"""Linears that keep a quantized checkpoint's weights quantized in memory (fp8 or 4/8-bit
codes with their scales, ``repack``'s storage) and compute ``x @ dequant(W).T + bias``.

The weight is dequantized per call, a block of output rows at a time (on the CPU by one C++
pass, ``sluicegate.kernels.quant_dequant``, else by torch: the same bits), into the activations'
dtype: memory holds the quantized weight plus one block, never the whole dense weight. An
fp8 scheme's dynamic activation quantization is emulated (rounded to fp8 and back, as
compressed-tensors does on a CPU), so the product is the checkpoint's, up to the GEMM's own
rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sluicegate.engine.models.quant.repack import repack
from sluicegate.engine.models.quant.scheme import QuantScheme, UnsupportedQuantizationError
from sluicegate.kernels import quant_dequant
from sluicegate.kernels.quant_reference import fake_quantize_fp8

# Weights dequantized at a time: 4M float32 are 16 MiB, small beside any model that needs it.
_BLOCK_ELEMENTS = 1 << 22
# Up to this many activation rows (decode steps), the CPU kernel multiplies as it dequantizes
# (bench/quantized_linear.py: 2-14x less time than dequantize-then-GEMM at 1-4 rows).
_FUSED_ROWS = 16


def _frozen(shape: tuple[int, ...], dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class QuantizedLinear(nn.Module):
    """One checkpoint linear ([out, in], no bias) in ``repack``'s storage."""

    def __init__(self, scheme: QuantScheme, in_features: int, out_features: int) -> None:
        super().__init__()
        self.scheme = scheme
        self.in_features = in_features
        self.out_features = out_features
        if scheme.is_fp8:
            self.group = scheme.block[1] if scheme.block else in_features
            groups = -(-in_features // self.group)
            self.weight = _frozen((out_features, in_features), torch.float8_e4m3fn)
        else:
            self.group = scheme.group_size or in_features
            if scheme.bits == 4 and in_features % 2:
                raise UnsupportedQuantizationError(
                    f"{scheme.method}: int4 codes of {in_features} input features (odd)"
                )
            # The last group may be short (GPTQ rounds the count of groups up).
            groups = -(-in_features // self.group)
            width = in_features // 2 if scheme.bits == 4 else in_features
            self.codes = _frozen((out_features, width), torch.uint8)
            self.zeros = _frozen((out_features, groups), torch.uint8)
            if scheme.act_order:
                self.g_idx = _frozen((in_features,), torch.int64)
        self.scales = _frozen((out_features, groups), torch.float32)
        group = scheme.activation_group
        if group is not None and in_features % group:
            raise UnsupportedQuantizationError(
                f"{scheme.method}: fp8 activations in groups of {group} with {in_features} "
                "input features (the group must divide them)"
            )

    @torch.no_grad()
    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Repacks the checkpoint's tensors for this linear into its storage."""
        stored = repack(self.scheme, tensors, self.out_features, self.in_features)
        for name, tensor in stored.items():
            destination = getattr(self, name)
            if destination.shape != tensor.shape:
                raise ValueError(
                    f"{name}: repacked shape {tuple(tensor.shape)} != {tuple(destination.shape)}"
                )
            destination.copy_(tensor)

    def dequantize(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Output rows ``start:stop`` of the weight, in float32."""
        rows = slice(start, stop)
        scales = self.scales[rows]
        compiled = quant_dequant.supports(scales) and not self.scheme.act_order
        if self.scheme.is_fp8:
            if compiled:
                return quant_dequant.dequantize_fp8(self.weight[rows], scales, self.group)
            return self._grouped(self.weight[rows].float(), None, scales)
        codes = self.codes[rows]
        if compiled:
            return quant_dequant.dequantize_int(
                codes, self.zeros[rows], scales, self.scheme.bits, self.group, self.in_features
            )
        if self.scheme.bits == 4:
            codes = torch.stack((codes & 15, codes >> 4), dim=-1).flatten(1)
        zeros = self.zeros[rows]
        if self.scheme.act_order:
            return (codes.float() - zeros[:, self.g_idx].float()) * scales[:, self.g_idx]
        return self._grouped(codes.float(), zeros.float(), scales)

    def _grouped(
        self, values: torch.Tensor, zeros: torch.Tensor | None, scales: torch.Tensor
    ) -> torch.Tensor:
        """(values - zeros) * scales, each [rows, groups] entry over its group of columns:
        broadcast over a [rows, groups, group] view where the groups tile the row (no
        expanded copies of the scales), else expanded and cut to the row's length."""
        rows, columns = values.shape
        if columns % self.group == 0:
            values = values.view(rows, -1, self.group)
            if zeros is not None:
                values = values - zeros.unsqueeze(-1)
            return (values * scales.unsqueeze(-1)).view(rows, columns)
        if zeros is not None:
            values = values - zeros.repeat_interleave(self.group, 1)[:, :columns]
        return values * scales.repeat_interleave(self.group, 1)[:, :columns]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` @ the weight's transpose (``x`` as the scheme quantizes it: the caller's
        business, done once for a projection's parts)."""
        tokens = x.reshape(-1, self.in_features)
        if x.is_cuda and not self.scheme.act_order:
            # Dequantized tile by tile inside the product: the dense weight never exists.
            from sluicegate.kernels.triton_quant_linear import quant_linear

            fp8 = self.scheme.is_fp8
            stored = self.weight if fp8 else self.codes
            zeros = None if fp8 else self.zeros
            return quant_linear(x, stored, zeros, self.scales, self.scheme.bits, self.group)
        if (
            tokens.shape[0] <= _FUSED_ROWS
            and not self.scheme.act_order
            and quant_dequant.supports(self.scales)
        ):
            return self._fused(tokens.float()).to(x.dtype).view(*x.shape[:-1], -1)
        rows = max(1, _BLOCK_ELEMENTS // self.in_features)
        if rows >= self.out_features:
            return F.linear(x, self.dequantize().to(x.dtype))
        blocks = [
            F.linear(x, self.dequantize(start, start + rows).to(x.dtype))
            for start in range(0, self.out_features, rows)
        ]
        return torch.cat(blocks, dim=-1)

    def _fused(self, x: torch.Tensor) -> torch.Tensor:
        if self.scheme.is_fp8:
            return quant_dequant.linear_fp8(x, self.weight, self.scales, self.group)
        return quant_dequant.linear_int(
            x, self.codes, self.zeros, self.scales, self.scheme.bits, self.group
        )


class QuantizedProjection(nn.Module):
    """A model's (possibly fused) projection over quantized checkpoint linears: q/k/v or
    gate/up stay separate products, each with its own scales (and act-order permutation),
    concatenated; the bias stays dense and fused."""

    def __init__(
        self,
        scheme: QuantScheme,
        in_features: int,
        part_sizes: list[int],
        bias: bool,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.scheme = scheme
        self.in_features = in_features
        self.out_features = sum(part_sizes)
        self.part_sizes = part_sizes
        self.parts = nn.ModuleList(QuantizedLinear(scheme, in_features, n) for n in part_sizes)
        self.bias = nn.Parameter(torch.empty(self.out_features, dtype=dtype)) if bias else None
        self._pending: list[dict[str, torch.Tensor]] = [{} for _ in part_sizes]
        self._unloaded = {(part, name) for part in range(len(part_sizes)) for name in ("w", "b")}
        if not bias:
            self._unloaded -= {(part, "b") for part in range(len(part_sizes))}

    @torch.no_grad()
    def load_checkpoint_tensor(self, part: int, name: str, tensor: torch.Tensor) -> None:
        """Takes one checkpoint tensor of checkpoint linear ``part``; a part's storage is
        filled once all of its tensors have come."""
        if name == "bias" and self.bias is not None:
            start = sum(self.part_sizes[:part])
            self.bias.narrow(0, start, self.part_sizes[part]).copy_(tensor)
            self._unloaded.discard((part, "b"))
            return
        linear = self.parts[part]
        expected = linear.scheme.tensors
        if name not in expected:
            raise UnsupportedQuantizationError(
                f"checkpoint tensor {name!r} of a {linear.scheme.layout} linear: "
                f"expected {', '.join(expected)}"
            )
        pending = self._pending[part]
        pending[name] = tensor
        if set(expected) <= pending.keys():
            linear.load(pending)
            self._pending[part] = {}
            self._unloaded.discard((part, "w"))

    def unloaded(self) -> list[str]:
        """What of the checkpoint never came, e.g. ``part 1 weights``."""
        return [
            f"part {part} {'weights' if kind == 'w' else 'bias'}"
            for part, kind in sorted(self._unloaded)
        ]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scheme.fp8_activations:
            x = fake_quantize_fp8(x, self.scheme.activation_group)
        if len(self.parts) == 1:
            out = self.parts[0](x)
        else:
            out = torch.cat([part(x) for part in self.parts], dim=-1)
        return out if self.bias is None else out + self.bias

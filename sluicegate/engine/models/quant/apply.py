"""Swaps a native model's projections for ``QuantizedProjection``s where its checkpoint stores
them quantized, before the weights are allocated (on the meta device) so no dense copy of
them is ever made."""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch
from torch import nn

from sluicegate.engine.models.quant.linear import QuantizedProjection
from sluicegate.engine.models.quant.scheme import QuantScheme, UnsupportedQuantizationError

# The projections a decoder layer has (our names; fused ones hold several checkpoint linears).
_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def quantize_projections(
    model: nn.Module,
    scheme: QuantScheme,
    checkpoint_names: Collection[str],
    parts: Callable[[str], list[tuple[str, int]]],
) -> int:
    """Replaces each projection whose checkpoint linears are all quantized (they store the
    layout's first non-``weight`` tensor) and returns how many. ``parts`` names the checkpoint
    linears behind a projection, with their output sizes, in order."""
    marker = next(name for name in scheme.tensors if name != "weight")
    names = set(checkpoint_names)
    swapped = 0
    for prefix, parent in list(model.named_modules()):
        for leaf, child in list(parent.named_children()):
            if leaf not in _PROJECTIONS or not isinstance(child, nn.Linear):
                continue
            full = f"{prefix}.{leaf}" if prefix else leaf
            linears = parts(full)
            quantized = [f"{linear}.{marker}" in names for linear, _ in linears]
            if not any(quantized):
                continue
            if not all(quantized):
                raise UnsupportedQuantizationError(
                    f"{full}: of {', '.join(name for name, _ in linears)} some are "
                    "quantized and some not"
                )
            with torch.device("meta"):
                replacement = QuantizedProjection(
                    scheme,
                    child.in_features,
                    [size for _, size in linears],
                    bias=child.bias is not None,
                    dtype=child.weight.dtype,
                )
            setattr(parent, leaf, replacement)
            swapped += 1
    return swapped

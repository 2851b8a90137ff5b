"""Quantized checkpoints (compressed-tensors fp8 and pack-quantized, HF/vLLM fp8, AWQ, GPTQ):
their schemes, the linears that keep their weights quantized, and the swap into a model."""

from sluicegate.engine.models.quant.scheme import (
    QuantScheme,
    UnsupportedQuantizationError,
    parse_quantization,
)

__all__ = ["QuantScheme", "UnsupportedQuantizationError", "parse_quantization"]

"""The per-rank arithmetic of ``sluicegate capacity``: weight bytes by format, split over
tensor-parallel ranks, and each rank's share of the KV heads. Plain Python: no torch.

Weights: float dtypes store every parameter at their width. The quantized formats store the
decoder layers' projections quantized, as llmcompressor, AutoAWQ and AutoGPTQ leave a
checkpoint: embeddings, LM head, norms and biases stay 16-bit, and scales are bf16:

    fp8, int8   1 byte a weight + a 2-byte scale per output row (per channel)
    int4        half a byte a weight + a 2-byte scale per group of 128 inputs

Tensor parallelism: projections and the vocabulary matrices are split over the ranks (column
or row parallel, vocab parallel); norms and biases are replicated (a few MB at most). The KV
cache is sharded by KV head; with fewer KV heads than ranks each rank holds one KV head,
replicated over ranks / KV heads of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from sluicegate.engine.model_shape import ModelShape

FLOAT_BYTES = {
    "float32": 4,
    "fp32": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "half": 2,
}
SCALE_BYTES = 2


@dataclass(frozen=True)
class QuantizedFormat:
    bits: int
    group: int | None  # inputs per scale; None: one scale per output row


QUANTIZED_FORMATS = {
    "fp8": QuantizedFormat(8, None),
    "float8": QuantizedFormat(8, None),
    "int8": QuantizedFormat(8, None),
    "int4": QuantizedFormat(4, 128),
}
WEIGHT_DTYPES = (*FLOAT_BYTES, *QUANTIZED_FORMATS)


@dataclass(frozen=True)
class WeightBytes:
    total: int
    per_rank: int


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def weight_bytes(
    shape: ModelShape, param_count: int, weight_dtype: str, ranks: int = 1
) -> WeightBytes:
    """All the weights' bytes, and one rank's of ``ranks``."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(
            f"unknown weight dtype {weight_dtype!r}; known: {', '.join(WEIGHT_DTYPES)}"
        )
    if not shape.has_parameter_formula:
        if weight_dtype in QUANTIZED_FORMATS:
            raise ValueError(
                f"--weight-dtype {weight_dtype} needs the projections' sizes, known for "
                f"the native families only, not {shape.model_type!r}"
            )
        # No breakdown of the parameters: all of them taken as split over the ranks.
        width = FLOAT_BYTES[weight_dtype]
        return WeightBytes(param_count * width, _ceil_div(param_count * width, ranks))
    linear, rows = shape.linear_weights()
    vocab = shape.vocab_weights()
    rest = param_count - linear - vocab  # norms and biases
    if weight_dtype in FLOAT_BYTES:
        width = FLOAT_BYTES[weight_dtype]
        sharded, replicated = (linear + vocab) * width, rest * width
    else:
        replicated = rest * 2
        fmt = QUANTIZED_FORMATS[weight_dtype]
        scales = rows if fmt.group is None else _ceil_div(linear, fmt.group)
        sharded = linear * fmt.bits // 8 + scales * SCALE_BYTES + vocab * 2
    return WeightBytes(sharded + replicated, _ceil_div(sharded, ranks) + replicated)


def kv_heads_per_rank(shape: ModelShape, ranks: int) -> int:
    """How many KV heads each of ``ranks`` holds (replicated where ranks outnumber them)."""
    if ranks < 1:
        raise ValueError(f"tensor parallel size must be >= 1, got {ranks}")
    if shape.num_heads % ranks:
        raise ValueError(f"{shape.num_heads} attention heads do not split over {ranks} ranks")
    kv = shape.num_kv_heads
    if kv >= ranks:
        if kv % ranks:
            raise ValueError(f"{kv} KV heads do not split over {ranks} ranks")
        return kv // ranks
    if ranks % kv:
        raise ValueError(f"{ranks} ranks do not replicate {kv} KV heads evenly")
    return 1

"""``sluicegate capacity``: how many sequences a GPU's KV cache holds, reserved vs paged.

Reproduces the seed article's arithmetic for any decoder config (``sluicegate.engine.model_shape``);
families without a parameter formula take their count from the folder's safetensors headers.
With N tensor-parallel ranks every figure is one rank's (each holds a slice of every token's
KV, so the deployment holds what one rank holds; ``capacity_sharding`` has the split):

    weights      = parameters x bytes per parameter (quantized: projections at their width
                   plus scales, the rest 16-bit), a rank's share of them
    KV budget    = GPU memory x utilization - a rank's weights
    KV per token = 2 (K and V) x layers x a rank's KV heads x head dim x bytes per element
    KV capacity  = whole blocks of ``block_size`` tokens that fit in the budget
    reserved     = capacity // reserved context length (static, per-request reservation)
    paged        = capacity // average tokens per request (blocks on demand)

Sizes use the article's units: GB is 10^9 bytes, GiB 2^30. Plain Python: no torch.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluicegate.engine.capacity_sharding import WEIGHT_DTYPES, kv_heads_per_rank, weight_bytes
from sluicegate.engine.model_shape import ModelShape, checkpoint_param_count

__all__ = ["ModelShape", "checkpoint_param_count", "main", "parse_size", "plan_capacity"]

# KV cache element widths.
DTYPE_BYTES = {
    "float32": 4,
    "fp32": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "float8": 1,
    "fp8": 1,
}
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


@dataclass(frozen=True)
class CapacityPlan:
    shape: ModelShape
    dtype: str
    kv_dtype: str
    gpu_memory_bytes: int
    utilization: float
    block_size: int
    avg_tokens: int
    reserves: tuple[int, ...]
    param_count: int
    weight_bytes: int
    kv_bytes_per_token: int  # one rank's
    tensor_parallel_size: int
    rank_weight_bytes: int
    kv_heads_per_rank: int
    kv_budget_bytes: int
    kv_capacity_blocks: int

    @property
    def kv_capacity_tokens(self) -> int:
        return self.kv_capacity_blocks * self.block_size

    def max_seqs(self, tokens_per_seq: int) -> int:
        # A sequence holds whole blocks, so count in blocks.
        return self.kv_capacity_blocks // -(-tokens_per_seq // self.block_size)

    @property
    def max_seqs_reserved(self) -> dict[str, int]:
        return {str(reserve): self.max_seqs(reserve) for reserve in self.reserves}

    @property
    def max_seqs_paged(self) -> int:
        return self.max_seqs(self.avg_tokens)

    @property
    def smallest_reserve(self) -> int:
        return min(self.reserves)

    @property
    def paged_vs_reserved_ratio(self) -> float | None:
        baseline = self.max_seqs(self.smallest_reserve)
        return self.max_seqs_paged / baseline if baseline else None

    def as_dict(self) -> dict[str, Any]:
        ratio = self.paged_vs_reserved_ratio
        return {
            "model_type": self.shape.model_type,
            "num_layers": self.shape.num_layers,
            "num_kv_heads": self.shape.num_kv_heads,
            "head_dim": self.shape.head_dim,
            "sliding_windows": list(self.shape.layer_windows),
            "dtype": self.dtype,
            "kv_dtype": self.kv_dtype,
            "gpu_memory_bytes": self.gpu_memory_bytes,
            "utilization": self.utilization,
            "block_size": self.block_size,
            "param_count": self.param_count,
            "weight_bytes": self.weight_bytes,
            "tensor_parallel_size": self.tensor_parallel_size,
            "rank_weight_bytes": self.rank_weight_bytes,
            "kv_heads_per_rank": self.kv_heads_per_rank,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_budget_bytes": self.kv_budget_bytes,
            "kv_capacity_blocks": self.kv_capacity_blocks,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "avg_tokens": self.avg_tokens,
            "max_seqs_reserved": self.max_seqs_reserved,
            "max_seqs_paged": self.max_seqs_paged,
            "paged_vs_reserved_ratio": None if ratio is None else round(ratio, 2),
        }


def plan_capacity(
    config: dict[str, Any],
    *,
    gpu_memory_bytes: int,
    utilization: float = 0.9,
    avg_tokens: int = 2000,
    reserves: tuple[int, ...] = (131072, 8192),
    block_size: int = 16,
    dtype: str = "bfloat16",
    kv_dtype: str | None = None,
    param_count: int | None = None,
    tensor_parallel_size: int = 1,
) -> CapacityPlan:
    """``dtype``: the weights' (a float dtype or a quantized format: fp8, int8, int4);
    ``kv_dtype`` defaults to it where it is a KV dtype, else bfloat16. ``param_count`` (e.g.
    from ``checkpoint_param_count``) is needed for model types without a parameter formula;
    the KV side is read from any decoder config."""
    kv_dtype = kv_dtype or (dtype if dtype in DTYPE_BYTES else "bfloat16")
    if kv_dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown KV dtype {kv_dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization}")
    if min(avg_tokens, block_size, *reserves) < 1:
        raise ValueError("token counts and block size must be >= 1")
    shape = ModelShape.from_config(config)
    if param_count is None:
        param_count = shape.parameter_count()
    weights = weight_bytes(shape, param_count, dtype, tensor_parallel_size)
    kv_heads = kv_heads_per_rank(shape, tensor_parallel_size)
    # Rounded to whole bytes: 80 GB x 0.9 is 72e9, not 72e9 minus a float's error.
    kv_budget = round(gpu_memory_bytes * utilization) - weights.per_rank
    if kv_budget <= 0:
        raise ValueError(
            f"the weights ({_gb(weights.per_rank)} a rank) leave no KV budget in "
            f"{_gb(gpu_memory_bytes)} x {utilization}"
        )
    per_token = shape.kv_bytes_per_token(DTYPE_BYTES[kv_dtype], kv_heads)
    return CapacityPlan(
        shape=shape,
        dtype=dtype,
        kv_dtype=kv_dtype,
        gpu_memory_bytes=gpu_memory_bytes,
        utilization=utilization,
        block_size=block_size,
        avg_tokens=avg_tokens,
        reserves=reserves,
        param_count=param_count,
        weight_bytes=weights.total,
        kv_bytes_per_token=per_token,
        tensor_parallel_size=tensor_parallel_size,
        rank_weight_bytes=weights.per_rank,
        kv_heads_per_rank=kv_heads,
        kv_budget_bytes=kv_budget,
        kv_capacity_blocks=kv_budget // (per_token * block_size),
    )


def parse_size(text: str) -> int:
    """``80GB`` -> 80e9 bytes, ``80GiB`` -> 80 * 2^30; a bare number is bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 80GB, 141GB, 24GiB)")
    return round(float(match.group(1)) * _UNITS[unit])


def load_config(path: str | Path) -> dict[str, Any]:
    """A ``config.json`` file, or a model folder holding one."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config.json at {path}")
    config: dict[str, Any] = json.loads(path.read_text())
    return config


def _gb(num_bytes: int) -> str:
    return f"{num_bytes / 1e9:,.2f} GB"


def _binary(num_bytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:g} {unit}"
    return f"{num_bytes} B"


def format_plan(plan: CapacityPlan) -> str:
    shape = plan.shape
    lines = [
        f"Model: {shape.model_type}, {shape.num_layers} layers, hidden {shape.hidden_size}, "
        f"{shape.num_heads} heads, {shape.num_kv_heads} KV heads, head dim {shape.head_dim}, "
        f"vocab {shape.vocab_size}, {'tied' if shape.tie_word_embeddings else 'untied'} embeddings",
        f"Parameters: {plan.param_count:,} parameters",
        f"Weights: {_gb(plan.weight_bytes)} weights ({plan.dtype})",
    ]
    ranks = plan.tensor_parallel_size
    rank = ""
    if ranks > 1:
        rank = " a rank"
        lines.append(
            f"Tensor parallel: {ranks} ranks, each {_gb(plan.rank_weight_bytes)} of weights and "
            f"{plan.kv_heads_per_rank} of {shape.num_kv_heads} KV heads "
            "(every figure below is one rank's; the deployment holds as many tokens)"
        )
    lines += [
        f"KV cache per token: {plan.kv_bytes_per_token:,} bytes ({_binary(plan.kv_bytes_per_token)}) "
        f"per token{rank} ({plan.kv_dtype})",
        f"KV budget: {_gb(plan.kv_budget_bytes)} KV budget ({_gb(plan.gpu_memory_bytes)} x "
        f"{plan.utilization:g} - {_gb(plan.rank_weight_bytes)} weights{rank})",
        f"KV capacity: {plan.kv_capacity_tokens:,} tokens "
        f"({plan.kv_capacity_blocks:,} blocks of {plan.block_size})",
        "Max concurrent sequences:",
    ]
    for reserve in plan.reserves:
        count = plan.max_seqs(reserve)
        lines.append(f"  static reservation: {count:,} sequences at {reserve:,} tokens each")
    lines.append(
        f"  paged (on demand): {plan.max_seqs_paged:,} sequences paged at "
        f"{plan.avg_tokens:,} tokens on average"
    )
    windows = sorted({w for w in shape.layer_windows if w})
    if windows:
        windowed = sum(1 for w in shape.layer_windows if w)
        lines.append(
            f"Sliding windows: {windowed} of {shape.num_layers} layers attend to the last "
            f"{', '.join(f'{w:,}' for w in windows)} tokens (the block pool keeps every layer's "
            "full context, so KV per token is unchanged)"
        )
    ratio = plan.paged_vs_reserved_ratio
    ratio_text = "n/a (no sequence fits the reservation)" if ratio is None else f"{ratio:.1f}x"
    lines.append(f"Paged vs reserved {plan.smallest_reserve:,}: ratio {ratio_text}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluicegate capacity",
        description="Plan KV-cache capacity: concurrent sequences under static reservation "
        "vs paged (on-demand) allocation. GB = 10^9 bytes, GiB = 2^30.",
    )
    parser.add_argument("--config", required=True, help="config.json or a model folder")
    parser.add_argument("--gpu-memory", type=parse_size, default=parse_size("80GB"))
    parser.add_argument("--utilization", type=float, default=0.9)
    parser.add_argument("--avg-tokens", type=int, default=2000)
    parser.add_argument(
        "--reserve",
        type=int,
        action="append",
        help="reserved context length per request; repeatable (default 131072 and 8192)",
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--weight-dtype",
        "--dtype",
        dest="dtype",
        default="bfloat16",
        choices=sorted(WEIGHT_DTYPES),
        help="the weights' dtype or quantized format (fp8, int8, int4: the projections "
        "quantized, embeddings and norms 16-bit)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        "--kv-dtype",
        dest="kv_dtype",
        choices=sorted(DTYPE_BYTES),
        help="default: the weight dtype where it is one, else bfloat16",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        "--tp",
        type=int,
        default=1,
        help="ranks the weights and KV heads are split over; figures are per rank",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = load_config(args.config)
        shape = ModelShape.from_config(config)
        plan = plan_capacity(
            config,
            param_count=None
            if shape.has_parameter_formula
            else checkpoint_param_count(args.config),
            gpu_memory_bytes=args.gpu_memory,
            utilization=args.utilization,
            avg_tokens=args.avg_tokens,
            reserves=tuple(args.reserve or (131072, 8192)),
            block_size=args.block_size,
            dtype=args.dtype,
            kv_dtype=args.kv_dtype,
            tensor_parallel_size=args.tensor_parallel_size,
        )
    except (OSError, ValueError, KeyError) as exc:
        message = f"missing config field {exc}" if isinstance(exc, KeyError) else str(exc)
        print(f"sluicegate capacity: {message}", file=sys.stderr)
        return 2
    print(json.dumps(plan.as_dict()) if args.json else format_plan(plan))
    return 0


if __name__ == "__main__":
    sys.exit(main())

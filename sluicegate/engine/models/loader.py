"""Builds a native model from a local Hugging Face folder (config.json + *.safetensors)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from sluicegate.engine.models.checkpoint import checkpoint_names, iter_checkpoint
from sluicegate.engine.models.config import ModelConfig, parse_dtype
from sluicegate.engine.models.llama import LlamaForCausalLM
from sluicegate.engine.models.quant.apply import quantize_projections
from sluicegate.engine.models.quant.scheme import UnsupportedQuantizationError, parse_quantization
from sluicegate.engine.models.qwen3 import Qwen3ForCausalLM
from sluicegate.engine.parallel.shard import ShardPlan, TensorParallel
from sluicegate.kernels import cpu_build

if TYPE_CHECKING:
    from sluicegate.engine.models.transformers_backend import TransformersCausalLM

logger = logging.getLogger(__name__)

ARCHITECTURES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}
_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


MODEL_IMPLS = ("auto", "native", "transformers")


class UnsupportedModelError(ValueError):
    pass


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    architecture = config.architecture or _BY_MODEL_TYPE.get(config.model_type, "")
    try:
        return ARCHITECTURES[architecture]
    except KeyError:
        raise UnsupportedModelError(
            f"unsupported architecture {architecture or config.model_type!r}; "
            f"supported: {', '.join(ARCHITECTURES)}"
        ) from None


def resolve_dtype(
    requested: str | torch.dtype, config: ModelConfig, device: torch.device
) -> torch.dtype:
    """``auto`` takes the checkpoint's dtype, as vLLM does; only a float16 checkpoint on a CPU
    without the CPU kernels runs as float32 (torch's own float16 matmuls there are slow)."""
    if isinstance(requested, torch.dtype):
        return requested
    if requested != "auto":
        return parse_dtype(requested)
    if device.type == "cpu" and config.dtype == torch.float16 and cpu_build.extension() is None:
        logger.info("dtype auto: a float16 checkpoint runs as float32 (no CPU kernels here)")
        return torch.float32
    return config.dtype


def has_native(raw_config: dict[str, Any]) -> bool:
    architectures = raw_config.get("architectures") or []
    architecture = architectures[0] if architectures else ""
    return (architecture or _BY_MODEL_TYPE.get(raw_config.get("model_type", ""), "")) in (
        ARCHITECTURES
    )


def choose_impl(raw_config: dict[str, Any], model_impl: str) -> str:
    """``native`` or ``transformers`` for this config; ``auto`` prefers native."""
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"unknown model_impl {model_impl!r}; choose one of {MODEL_IMPLS}")
    if model_impl != "auto":
        return model_impl
    return "native" if has_native(raw_config) else "transformers"


def shard_plan(path: Path, rank: int, size: int) -> ShardPlan:
    """Rank ``rank``'s slice of the checkpoint at ``path`` over ``size`` ranks."""
    raw = json.loads((Path(path) / "config.json").read_text())
    return ShardPlan.for_rank(ModelConfig.from_dict(raw), rank, size)


def load_model(
    path: str | Path,
    device: torch.device,
    dtype: str | torch.dtype = "auto",
    model_impl: str = "auto",
    tp: TensorParallel | None = None,
) -> LlamaForCausalLM | TransformersCausalLM:
    """The checkpoint at ``path`` on ``device``; with ``tp``, this rank's shard of it."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: expected a Hugging Face model folder")
    raw = json.loads(config_file.read_text())
    impl = choose_impl(raw, model_impl)
    logger.info("%s: the %s implementation (model_impl=%s)", path.name, impl, model_impl)
    if tp is not None and (impl == "transformers" or raw.get("quantization_config")):
        what = "the transformers backend" if impl == "transformers" else "quantized checkpoints"
        raise UnsupportedModelError(
            f"{path.name}: tensor parallelism serves unquantized checkpoints of the native "
            f"models ({', '.join(ARCHITECTURES)}), not {what}"
        )
    if impl == "transformers":
        quantization = raw.get("quantization_config")
        if quantization:
            # transformers would dequantize it whole or need GPU-only packages: not served.
            raise UnsupportedModelError(
                f"{path.name}: a quantized checkpoint (quant_method "
                f"{quantization.get('quant_method')!r}) is served by the native models only "
                f"({', '.join(ARCHITECTURES)}), not by the transformers backend"
            )
        from sluicegate.engine.models.transformers_backend import (
            UnsupportedTransformersModelError,
            load_transformers_model,
            resolve_hf_dtype,
        )

        try:
            return load_transformers_model(path, device, resolve_hf_dtype(dtype, raw, device))
        except UnsupportedTransformersModelError as exc:
            raise UnsupportedModelError(str(exc)) from None
    config = ModelConfig.from_dict(raw)
    cls = model_class(config)
    config.dtype = resolve_dtype(dtype, config, device)
    # Built on the meta device: no time spent on random init of weights about to be replaced.
    with torch.device("meta"):
        if tp is None:
            model = cls(config)
        else:
            model = cls(tp.plan.local_config(config))
            model.shard(tp)
    model = model.to(dtype=config.dtype)
    try:
        scheme = parse_quantization(raw.get("quantization_config"))
        if scheme is not None:
            # Swapped in after the cast, which would otherwise turn fp8 storage into bf16.
            count = quantize_projections(
                model, scheme, checkpoint_names(path), model.projection_parts
            )
            model.weight_dtype = "fp8" if scheme.is_fp8 else f"int{scheme.bits}"
            logger.info(
                "%s: quantized checkpoint, %d projections: %s",
                path.name,
                count,
                scheme.describe(),
            )
    except UnsupportedQuantizationError as exc:
        raise UnsupportedModelError(f"{path.name}: {exc}") from None
    model = model.to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.load_weights(iter_checkpoint(path))
    return model.eval()

"""An engine's model and model runner: load the weights, pick the linears, cap the context
and size the runner (KV cache, compilation, CUDA graphs) from ``EngineOptions``."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from sluicegate.engine.lora import LoraConfig, LoraManager
from sluicegate.engine.lora.layers import fuse_gated_mlps
from sluicegate.engine.models import UnsupportedModelError, load_model
from sluicegate.engine.models.cpu.linears import (
    choose_threads,
    describe_threads,
    resolve_cpu_linears,
    swap_cpu_linears,
)
from sluicegate.engine.models.llama import LlamaForCausalLM
from sluicegate.engine.options import EngineOptions
from sluicegate.engine.parallel.shard import TensorParallel
from sluicegate.engine.runner.attention import resolve_kv_cache_dtype
from sluicegate.engine.runner.model_runner import ModelRunner
from sluicegate.kernels import cpu_ops

if TYPE_CHECKING:
    from sluicegate.engine.models.transformers_backend import TransformersCausalLM

    Model = LlamaForCausalLM | TransformersCausalLM

logger = logging.getLogger(__name__)


def load_engine_model(
    model: str | Path,
    device: torch.device,
    options: EngineOptions,
    tp: TensorParallel | None = None,
) -> tuple[Model, LoraManager | None]:
    """The model (with ``tp``, this rank's shard) with its linears chosen, and its LoRA
    slots when ``max_loras`` > 0."""
    loaded = load_model(model, device, options.dtype, options.model_impl, tp)
    loras = None
    if options.max_loras:
        if not isinstance(loaded, LlamaForCausalLM):
            raise UnsupportedModelError(
                "LoRA adapters (--max-loras) are served on the native models only "
                "(Llama, Mistral, Qwen2, Qwen3), not on the transformers backend"
            )
        # Before the CPU linears are swapped: the swap then runs inside the LoRA wrappers.
        modules = options.lora_modules or {}
        # Room in host memory for every start-up adapter unless told otherwise.
        host = options.max_cpu_loras or max(options.max_loras, len(modules))
        loras = LoraManager(loaded, LoraConfig(options.max_loras, options.max_lora_rank, host))
        for name, path in modules.items():
            loras.load(name, path)
    # Inductor packs CPU weights for oneDNN itself; a compiled forward keeps nn.Linear.
    compiling = options.cpu_compile and not options.enforce_eager
    if not compiling:
        kind = resolve_cpu_linears(options.cpu_linears, loaded)
        if swap_cpu_linears(loaded, kind):
            logger.info("CPU linears: %s", kind)
        if loras is not None and kind == "packed":
            fuse_gated_mlps(loaded)
    if device.type == "cpu" and isinstance(loaded, LlamaForCausalLM):
        fused = cpu_ops.supports(torch.empty(0, dtype=loaded.config.dtype))
        logger.info(
            "layer ops (RMSNorm, residual, rotary, SiLU x mul, KV write): %s",
            "C++ (csrc/layer_ops.cpp)" if fused else "torch (the CPU kernels are not built)",
        )
        if not compiling and torch.get_num_threads() > 1:
            logger.info(
                "one thread, not %d, for: %s",
                torch.get_num_threads(),
                describe_threads(choose_threads(loaded, loaded.config.dtype)),
            )
    return loaded, loras


def context_length(model: Model, options: EngineOptions) -> int:
    config = model.config
    length = options.max_model_len or config.max_position_embeddings
    if config.sliding_window and length > config.sliding_window:
        logger.warning(
            "context length capped at the model's sliding window of %d tokens",
            config.sliding_window,
        )
        length = config.sliding_window
    return length


def build_runner(
    model: Model,
    device: torch.device,
    options: EngineOptions,
    max_model_len: int,
    loras: LoraManager | None = None,
) -> ModelRunner:
    # The native models only: the transformers backend reads sequence lengths on the
    # host inside its forward, which neither a CUDA graph nor Dynamo can hold. Nor under
    # tensor parallelism, whose other ranks run each step eagerly, as rank 0 sends it.
    compilable = isinstance(model, LlamaForCausalLM) and options.tensor_parallel_size == 1
    return ModelRunner(
        model,
        device,
        block_size=options.block_size,
        max_num_seqs=options.max_num_seqs,
        max_num_batched_tokens=options.max_num_batched_tokens,
        max_model_len=max_model_len,
        num_kv_blocks=options.num_kv_blocks,
        kv_cache_memory=options.kv_cache_memory,
        gpu_memory_utilization=options.gpu_memory_utilization,
        attention_backend=options.attention_backend,
        compile_model=compilable
        and not options.enforce_eager
        and (device.type == "cuda" or options.cpu_compile),
        cuda_graphs=compilable and not options.enforce_eager and device.type == "cuda",
        kv_cache_dtype=resolve_kv_cache_dtype(options.kv_cache_dtype, model.config.dtype),
        loras=loras,
    )

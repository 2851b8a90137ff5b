"""How an engine is built (``EngineOptions``) and which device it runs on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(kw_only=True)
class EngineOptions:
    """How one engine is built. KV cache size: ``num_kv_blocks`` if given; else on CUDA
    ``gpu_memory_utilization`` x total memory less weights and peak activations; else on CPU
    ``kv_cache_memory`` bytes (default 1 GiB). ``max_model_len`` defaults to the model's
    ``max_position_embeddings``; ``attention_backend`` is "triton", "cpu" or "torch" (default by
    device, or ``SLUICEGATE_ATTENTION_BACKEND``); ``seed`` seeds unseeded sampling."""

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    max_waiting: int | None = None
    device: str = "auto"
    dtype: str = "auto"
    attention_backend: str | None = None
    seed: int | None = None
    # CPU only: torch intra-op threads for the process; None keeps torch's default (every
    # core). On a machine shared with other busy processes, 1 can be far faster: each op
    # splits its work evenly, so a thread that is not scheduled stalls the whole op.
    num_threads: int | None = None
    # CPU float32 only: the linears' kernel, "auto", "packed", "onednn" or "torch" (see
    # sluicegate.engine.models.cpu.linears).
    cpu_linears: str = "auto"
    # "native" (our own Llama/Mistral/Qwen2/Qwen3 code), "transformers" (the checkpoint's
    # transformers class on our paged attention), or "auto": native where there is one.
    model_impl: str = "auto"
    # Tool-call format ("hermes", "llama3_json"); None detects it from the chat template.
    tool_parser: str | None = None
    # On CUDA the forward is compiled (torch.compile) and decode steps replay CUDA graphs,
    # both prepared at start-up; True runs plain eager PyTorch instead.
    enforce_eager: bool = False
    # On CPU, torch.compile of the forward too. Off by default: on this project's CPUs it
    # measured slower than eager with oneDNN linears (bench/engine_throughput.py
    # --cpu-compile: 0.93x), and it adds a minute or more of start-up.
    cpu_compile: bool = False
    # Schedule and prepare step N+1 while step N runs on the device (its host-side output
    # work overlaps step N+1 in turn). None: on CUDA only, where the device runs ahead of
    # the host; on CPU the same path runs, correct but no faster (the forward is blocking).
    async_scheduling: bool | None = None
    # Speculative decoding as vLLM configures it, e.g. {"method": "ngram",
    # "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    # (sluicegate.engine.spec.config); None: off.
    speculative_config: dict[str, Any] | None = None
    # Ranks the model is split over (sluicegate.engine.parallel.ranks): processes on
    # this machine, one per GPU on CUDA; on the CPU they share its cores.
    tensor_parallel_size: int = 1
    # "auto" (the model's dtype), or "fp8" / "fp8_e4m3" / "fp8_e5m2": a byte per cached value,
    # twice bf16's tokens in the same memory (sluicegate.engine.runner.attention).
    kv_cache_dtype: str = "auto"
    # LoRA adapters (docs/lora.md): up to max_loras distinct adapters in one step (device
    # slots; 0: LoRA off), of rank up to max_lora_rank, max_cpu_loras held in host memory
    # (None: max_loras); lora_modules (name -> peft folder) are loaded at start-up.
    max_loras: int = 0
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: dict[str, str] | None = None
    # Note every block entering and leaving the prefix cache, for the worker to publish
    # (KV events, docs/kv-events.md); off for offline use, where nobody takes them.
    kv_events: bool = False

    def __post_init__(self) -> None:
        # Checked here, before any model loads.
        if self.lora_modules and not self.max_loras:
            raise ValueError("--lora-modules needs --max-loras of at least 1")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)

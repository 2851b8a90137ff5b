"""Paged attention layer and the choice of backend behind it.

Three backends share one interface (``store_kv`` + ``paged_attention`` with the signatures of
``sluicegate.kernels.reference``): ``triton`` (the kernels package; default on CUDA, and usable on CPU
tensors under ``TRITON_INTERPRET=1``), ``cpu`` (``sluicegate.kernels.cpu_attention``: the reference with
a compiled C++ decode kernel; default on the CPU when it can be built) and ``torch``
(``sluicegate.kernels.reference``, the CPU default without a C++ compiler). An explicit engine option
wins over ``SLUICEGATE_ATTENTION_BACKEND``, which wins over the device default.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

logger = logging.getLogger(__name__)

KV_CACHE_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """``--kv-cache-dtype``: ``auto`` keeps the model's dtype; ``fp8`` (e4m3) and ``fp8_e5m2``
    hold a byte per value, so the same memory holds twice bf16's tokens. An fp8 cache holds the
    values themselves, rounded (a scale of 1, vLLM's default without calibrated scales), and
    the attention reads them back into float32."""
    if name == "auto":
        return model_dtype
    if name not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype {name!r} is not supported (choose auto, {', '.join(KV_CACHE_DTYPES)})"
        )
    return KV_CACHE_DTYPES[name]


BACKENDS = ("triton", "cpu", "torch")
BACKEND_ENV = "SLUICEGATE_ATTENTION_BACKEND"


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    store_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]


def _device_default(device: torch.device) -> str:
    if device.type == "cuda":
        return "triton"
    from sluicegate.kernels import cpu_attention

    return "cpu" if cpu_attention.available() else "torch"


def resolve_backend_name(requested: str | None, device: torch.device) -> str:
    name = requested or os.environ.get(BACKEND_ENV) or _device_default(device)
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKENDS}")
    return name


def _reason(requested: str | None, name: str) -> str:
    if requested:
        return "asked for by the engine's options"
    if os.environ.get(BACKEND_ENV):
        return f"asked for by {BACKEND_ENV}"
    if name == "triton":
        return "the default on CUDA"
    if name == "cpu":
        return "the CPU default: the C++ kernels read the paged cache in place"
    return "the CPU kernels could not be built here (no C++ compiler?)"


def load_backend(requested: str | None, device: torch.device) -> AttentionBackend:
    name = resolve_backend_name(requested, device)
    logger.info("attention backend: %s (%s)", name, _reason(requested, name))
    if name == "triton":
        from sluicegate import kernels

        return AttentionBackend(name, kernels.store_kv, kernels.paged_attention)
    if name == "cpu":
        from sluicegate.kernels import cpu_attention

        return AttentionBackend(name, cpu_attention.store_kv, cpu_attention.paged_attention)
    from sluicegate.kernels import reference

    return AttentionBackend(name, reference.store_kv, reference.paged_attention)


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each request's queries may see."""

    backend: AttentionBackend
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    # How many leading requests are one-token decodes (None: all, if there are as many
    # tokens as requests, else none): the Triton kernel runs them with decode tiles.
    num_decodes: int | None = None


class PagedAttention(nn.Module):
    """Writes this step's K/V into the layer's cache, then attends through the block tables.

    The model runner assigns ``k_cache``/``v_cache`` (views into one allocation) after it has
    sized the cache; until then they are empty.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # Set by sluicegate.engine.runner.compilation.register_layers: then the layer runs as the opaque
        # custom op that compiled and graph-captured forwards need.
        self.layer_id: int | None = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        if self.layer_id is not None:
            return torch.ops.sluicegate.paged_attention(q, k, v, self.layer_id)
        meta.backend.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        return meta.backend.paged_attention(
            q,
            self.k_cache,
            self.v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.cu_seqlens_q,
            self.scale,
            num_decodes=meta.num_decodes,
        )

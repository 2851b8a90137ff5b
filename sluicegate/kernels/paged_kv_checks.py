"""Argument checks every paged-KV Triton kernel makes (the cache write and the attention), each
a ValueError naming what is off: a kernel would read or write out of bounds instead."""

from __future__ import annotations

import torch


def check_kv_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """One paged layout for both caches: [num_blocks, block_size, num_kv_heads, head_dim]."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} must match, "
            "[num_blocks, block_size, num_kv_heads, head_dim]"
        )
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must share a memory layout")


def check_one_device(*tensors: torch.Tensor) -> None:
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")

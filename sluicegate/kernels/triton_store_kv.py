"""Triton KV-cache write: scatter each new token's K/V rows into its paged-cache slot.

Maths in ``sluicegate.kernels.reference.store_kv``. One program per token moves all its KV heads at once
(a [heads, head_dim] tile), so the grid stays small and each program does one contiguous-ish
read and one scattered write.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluicegate.kernels.paged_kv_checks import check_kv_caches, check_one_device

__all__ = ["store_kv"]


# The slot mapping is a slice of the step's staging buffer at an offset that changes with
# the batch: no alignment specialisation, or each alignment would compile mid-serving.
@triton.jit(do_not_specialize_on_alignment=["slot_mapping_ptr"])
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]

    key = tl.load(
        key_ptr + token * stride_key_token + heads[:, None] * stride_key_head + dims[None, :],
        mask=mask,
    )
    value = tl.load(
        value_ptr + token * stride_value_token + heads[:, None] * stride_value_head + dims[None, :],
        mask=mask,
    )
    dest = (
        (slot // BLOCK_SIZE) * stride_cache_block
        + (slot % BLOCK_SIZE) * stride_cache_offset
        + heads[:, None] * stride_cache_head
        + dims[None, :]
    )
    tl.store(k_cache_ptr + dest, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dest, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write K/V rows into ``k_cache``/``v_cache`` in place; slot -1 skips the token."""
    _check_store_kv(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
    )


def _check_store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must match, 3-D")
    check_kv_caches(k_cache, v_cache)
    if key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"key heads/dim {tuple(key.shape[1:])} != cache {tuple(k_cache.shape[2:])}"
        )
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} needs one slot per token")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slot_mapping must be int32/int64, got {slot_mapping.dtype}")
    for name, tensor in (("key", key), ("value", value), ("k_cache", k_cache)):
        if tensor.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim")
    check_one_device(key, value, k_cache, v_cache, slot_mapping)

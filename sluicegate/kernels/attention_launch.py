"""Launch planning for the paged-attention kernel (``sluicegate.kernels.triton_paged_attention``): its
compile-time tiles from the per-GPU-family table, how many parts the key range of decode
requests is split into, and the checks its arguments must pass. Host-side only; no kernel
here."""

from __future__ import annotations

import functools
import math
import os

import torch
import triton

from sluicegate.kernels.launch_configs import TileConfig, family_config, tile_config
from sluicegate.kernels.paged_kv_checks import check_kv_caches, check_one_device

# Split the key range only while each part keeps at least this many keys: shorter parts cost
# more in partial writes and the reduce than they win in parallelism.
_MIN_KEYS_PER_SPLIT = 256
_MAX_SPLITS = 16


def _tile_config(device: torch.device, is_decode: bool, head_dim: int) -> TileConfig:
    capability = _capability(device.index) if device.type == "cuda" else None
    return tile_config(
        family_config(capability),
        is_decode=is_decode,
        head_dim_pad=triton.next_power_of_2(head_dim),
    )


@functools.cache
def _capability(device_index: int | None) -> tuple[int, int]:
    index = torch.cuda.current_device() if device_index is None else device_index
    return torch.cuda.get_device_capability(index)


def plan_tiles(
    *,
    is_decode: bool,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    interpreting: bool,
    config: TileConfig | None = None,
) -> dict[str, object]:
    """The attention kernel's compile-time parameters, all but ``NUM_SPLITS``.

    Row and key tiles come from ``config`` (default: the table's entry for no GPU family):
    decode uses the smallest row tile the tensor cores take (16), filled by the GQA group;
    prefill more rows. Key tiles span at least one cache block.
    """
    head_dim_pad = triton.next_power_of_2(head_dim)
    if config is None:
        config = tile_config(family_config(None), is_decode=is_decode, head_dim_pad=head_dim_pad)
    block_m = max(config.block_m, triton.next_power_of_2(group))
    return {
        "GROUP": group,
        "HEAD_DIM": head_dim,
        "HEAD_DIM_PAD": head_dim_pad,
        "BLOCK_SIZE": block_size,
        "TILE_N": max(block_size, config.tile_n),
        "BLOCK_M": block_m,
        "BLOCK_Q": block_m // group,
        "UPCAST_INPUTS": interpreting,
        # fp32 operands get exact fp32 products, not TF32 (which only fp32 dots would use).
        "DOT_PRECISION": "ieee" if interpreting or dtype == torch.float32 else "tf32",
    }


def split_counts(
    device: torch.device, num_kv_heads: int, max_num_seqs: int, max_context: int
) -> list[int]:
    """Every split count ``default_num_splits`` can return for this model on ``device``."""
    if device.type != "cuda":
        return [1]
    sm_count = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    counts = {
        _splits_for(sm_count, seqs * num_kv_heads, context)
        for seqs in range(1, max_num_seqs + 1)
        for context in (max_context,)
    }
    # Narrower block tables (shorter contexts) give every smaller count too.
    return sorted({1 << i for c in counts for i in range(c.bit_length())})


def _interpreting() -> bool:
    # The interpreter computes bf16 arithmetic wrongly, so there every input is upcast to fp32
    # right after loading; on a GPU, fp16/bf16 feed the tensor cores directly (fp32 accumulate).
    return os.environ.get("TRITON_INTERPRET") == "1"


def default_num_splits(
    q: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    num_kv_heads: int,
    *,
    num_decodes: int | None = None,
) -> int:
    """Key-range splits for the decode requests of a batch (all of its requests unless
    ``num_decodes`` says how many lead): more than 1 only when they leave SMs idle."""
    if num_decodes is None:
        num_decodes = block_tables.shape[0] if q.shape[0] == block_tables.shape[0] else 0
    if q.device.type != "cuda" or num_decodes == 0:
        return 1
    index = q.device.index
    sm_count = _sm_count(torch.cuda.current_device() if index is None else index)
    # The table's width bounds the longest context without reading seq_lens on the host.
    return _splits_for(sm_count, num_decodes * num_kv_heads, block_tables.shape[1] * block_size)


def _splits_for(sm_count: int, programs: int, max_context: int) -> int:
    if programs >= sm_count:
        return 1
    wanted = min(math.ceil(2 * sm_count / programs), max_context // _MIN_KEYS_PER_SPLIT)
    wanted = min(wanted, _MAX_SPLITS)
    return 1 if wanted < 2 else 1 << (wanted.bit_length() - 1)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def check_paged_attention_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
) -> None:
    """The kernel's contract on shapes, dtypes, layouts and devices, as a ValueError or
    TypeError naming what is off (a kernel would read out of bounds instead)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, num_heads, head_dim], got {tuple(q.shape)}")
    check_kv_caches(k_cache, v_cache)
    if q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"q head_dim {q.shape[2]} != cache head_dim {k_cache.shape[3]}")
    if q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"{q.shape[1]} query heads not a multiple of {k_cache.shape[2]} KV heads")
    if q.dtype != k_cache.dtype or k_cache.dtype != v_cache.dtype:
        raise TypeError(f"q {q.dtype} and caches {k_cache.dtype}/{v_cache.dtype} must match")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"unsupported dtype {q.dtype}")
    num_seqs = seq_lens.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables {tuple(block_tables.shape)} needs one row per request")
    if cu_seqlens_q.shape != (num_seqs + 1,):
        raise ValueError(f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} must have num_seqs + 1 items")
    for name, tensor in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if tensor.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be int32/int64, got {tensor.dtype}")
    if cu_seqlens_q.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens_q must be int32/int64, got {cu_seqlens_q.dtype}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("q, the caches and block_tables must be contiguous in the last dim")
    if not (seq_lens.is_contiguous() and cu_seqlens_q.is_contiguous()):
        raise ValueError("seq_lens and cu_seqlens_q must be contiguous")
    check_one_device(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q)

"""Triton paged attention: one varlen kernel for prefill, chunked prefill and decode.

Maths in ``sluicegate.kernels.reference.paged_attention``. Layout of the work:

* A program owns ``BLOCK_Q`` query tokens of one request and all ``GROUP`` query heads that
  share one KV head, flattened into ``BLOCK_M = BLOCK_Q * GROUP`` rows (padded to a power of
  two). Each K/V tile is then read once for the whole group, which is what makes GQA decode
  memory-efficient.
* Programs are laid out over all requests' query blocks without a host sync: request i's
  blocks start at ``cu_seqlens_q[i] // BLOCK_Q + i`` (an upper bound on the blocks before it),
  each program finds its request by binary search, and spare programs exit at once.
* A launch covers requests ``[seq_begin, num_seqs)`` (offsets counted from there), so a mixed
  batch whose leading requests are one-token decodes (the engine's order) runs them with
  decode tiles and the rest with prefill tiles: two launches, same tensors, no host sync.
* Keys are walked in tiles of ``TILE_N`` positions (several cache blocks) through the block
  table, with an online softmax in fp32 (exp2 domain).
* Split-KV: with ``num_splits > 1`` the key range of each request is cut into that many
  parts, each program writes a partial output and its log-sum-exp, and a reduce kernel merges
  them. The launcher picks it for decode batches too small to fill the GPU.
* Tile sizes, warps and pipeline stages per GPU family come from ``sluicegate.kernels.launch_configs``.
  Request counts, offsets and the block-table stride are not specialised on (Triton would
  otherwise compile new variants as they cross 1 or multiples of 16 mid-serving), nor the
  alignment of the metadata pointers (slices of one staging buffer), so ``warm_up`` can
  compile every variant a model can meet at start-up.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sluicegate.kernels.attention_launch import (
    _interpreting,
    _tile_config,
    check_paged_attention_args,
    default_num_splits,
    plan_tiles,
    split_counts,
)

__all__ = ["default_num_splits", "paged_attention", "plan_tiles", "warm_up"]

_LOG2_E = 1.4426950408889634


@triton.jit(
    do_not_specialize=["num_seqs", "seq_begin", "token_begin", "stride_table_seq"],
    # Slices of one staging buffer at offsets that change with the batch: read a scalar at a
    # time, they gain nothing from an alignment guarantee, which would otherwise compile a
    # variant per alignment mid-serving.
    do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr", "cu_seqlens_q_ptr"],
)
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    cu_seqlens_q_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    scale_log2,
    num_seqs,
    seq_begin,
    token_begin,
    stride_q_token,
    stride_q_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_offset,
    stride_cache_head,
    stride_table_seq,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    UPCAST_INPUTS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP

    # The request whose query blocks contain this program: the last i with start(i) <= q_block,
    # start(i) = (cu_seqlens_q[i] - token_begin) // BLOCK_Q + (i - seq_begin).
    low = tl.full([], 0, tl.int32) + seq_begin
    high = tl.full([], 0, tl.int32) + num_seqs
    while low < high:
        mid = (low + high) // 2
        if (tl.load(cu_seqlens_q_ptr + mid) - token_begin) // BLOCK_Q + mid - seq_begin <= q_block:
            low = mid + 1
        else:
            high = mid
    seq = low - 1

    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    local_block = q_block - ((q_start - token_begin) // BLOCK_Q + seq - seq_begin)
    if local_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    cached_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    token = local_block * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (token < q_len)
    query_pos = cached_len + token
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    token_index = (q_start + token).to(tl.int64)

    q = tl.load(
        q_ptr
        + token_index[:, None] * stride_q_token
        + head[:, None] * stride_q_head
        + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    if UPCAST_INPUTS:
        q = q.to(tl.float32)

    # Keys up to the last query of this block (causal), cut into this program's split.
    kv_end = tl.minimum(cached_len + (local_block + 1) * BLOCK_Q, seq_len)
    if NUM_SPLITS > 1:
        keys_per_split = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), TILE_N) * TILE_N
        kv_begin = split * keys_per_split
        kv_end = tl.minimum(kv_begin + keys_per_split, kv_end)
    else:
        kv_begin = 0

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    tile = tl.arange(0, TILE_N)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_table_seq
    for tile_start in range(kv_begin, kv_end, TILE_N):
        key_pos = tile_start + tile
        key_valid = key_pos < kv_end
        block = tl.load(table_row + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        slot_offset = (
            block * stride_cache_block
            + (key_pos % BLOCK_SIZE) * stride_cache_offset
            + kv_head * stride_cache_head
        )
        k = tl.load(
            k_cache_ptr + slot_offset[None, :] + dims[:, None],
            mask=key_valid[None, :] & dim_valid[:, None],
            other=0.0,
        )
        v = tl.load(
            v_cache_ptr + slot_offset[:, None] + dims[None, :],
            mask=key_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )
        if UPCAST_INPUTS:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        scores = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
        visible = key_valid[None, :] & (key_pos[None, :] <= query_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # A row that has seen no visible key yet keeps m = -inf; shift by 0 to avoid inf - inf.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(scores - m_shift[:, None])
        alpha = tl.exp2(m_i - m_shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    store_mask = row_valid[:, None] & dim_valid[None, :]
    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(
            out_ptr
            + token_index[:, None] * stride_out_token
            + head[:, None] * stride_out_head
            + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=store_mask,
        )
    else:
        # An empty split (short request) leaves l = 0: it stores lse = -inf and weighs nothing.
        empty = l_i == 0.0
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        partial_row = (token_index * num_heads + head) * NUM_SPLITS + split
        tl.store(
            partial_out_ptr + partial_row[:, None] * HEAD_DIM + dims[None, :],
            out,
            mask=store_mask,
        )
        tl.store(partial_lse_ptr + partial_row, lse, mask=row_valid)


@triton.jit
def _merge_splits_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    stride_out_token,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    first_row = (token * tl.num_programs(1) + head) * NUM_SPLITS
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM

    lse = tl.load(partial_lse_ptr + first_row + splits)
    weights = tl.exp2(lse - tl.max(lse, 0))
    weights = weights / tl.sum(weights, 0)
    parts = tl.load(
        partial_out_ptr + (first_row + splits)[:, None] * HEAD_DIM + dims[None, :],
        mask=dim_valid[None, :],
        other=0.0,
    )
    out = tl.sum(parts * weights[:, None], 0)
    tl.store(
        out_ptr + token * stride_out_token + head * stride_out_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_valid,
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    softmax_scale: float,
    *,
    num_splits: int | None = None,
    num_decodes: int | None = None,
) -> torch.Tensor:
    """Causal varlen attention over a paged KV cache; see ``sluicegate.kernels.reference.paged_attention``.

    ``num_decodes``: how many leading requests have one query token (a host-side hint the
    engine knows; default: all of them when there are as many tokens as requests, else
    none). Those run with decode tiles, the rest with prefill tiles; the result does not
    depend on the hint, only the speed. ``num_splits`` forces the split-KV variant for the
    decode requests (a power of two; 1 turns it off); by default the launcher splits decode
    batches whose (request, KV head) programs would not fill the GPU.
    """
    check_paged_attention_args(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q)
    num_tokens = q.shape[0]
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    if num_decodes is None:
        num_decodes = num_seqs if num_tokens == num_seqs else 0
    if not 0 <= num_decodes <= min(num_seqs, num_tokens):
        raise ValueError(f"num_decodes {num_decodes} out of range for {num_seqs} requests")
    if num_splits is not None and (num_splits < 1 or num_splits & (num_splits - 1)):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    args = (q, k_cache, v_cache, out, block_tables, seq_lens, cu_seqlens_q, softmax_scale)
    if num_decodes:
        if num_splits is None:
            num_splits = default_num_splits(q, block_tables, k_cache.shape[1], k_cache.shape[2],
                                            num_decodes=num_decodes)  # fmt: skip
        _launch(*args, seqs=(0, num_decodes), tokens=(0, num_decodes), num_splits=num_splits)
    if num_decodes < num_seqs:
        _launch(*args, seqs=(num_decodes, num_seqs), tokens=(num_decodes, num_tokens),
                num_splits=1)  # fmt: skip
    return out


def _launch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    softmax_scale: float,
    *,
    seqs: tuple[int, int],
    tokens: tuple[int, int],
    num_splits: int,
) -> None:
    """One launch over requests ``seqs`` (whose queries are tokens ``tokens``): decode tiles
    when each has one token, else prefill tiles."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    seq_begin, seq_end = seqs
    token_begin, token_end = tokens
    is_decode = token_end - token_begin == seq_end - seq_begin
    config = _tile_config(q.device, is_decode, head_dim)
    tiles = plan_tiles(
        is_decode=is_decode,
        group=num_heads // num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=q.dtype,
        interpreting=_interpreting(),
        config=config,
    )
    if num_splits > 1:
        # Indexed by absolute token: a decode launch covers tokens [0, token_end).
        partial_out = torch.empty(token_end, num_heads, num_splits, head_dim,
                                  dtype=torch.float32, device=q.device)  # fmt: skip
        partial_lse = torch.empty(token_end, num_heads, num_splits,
                                  dtype=torch.float32, device=q.device)  # fmt: skip
    else:
        partial_out = partial_lse = out
    num_q_blocks = (token_end - token_begin) // tiles["BLOCK_Q"] + seq_end - seq_begin
    _paged_attention_kernel[(num_q_blocks, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        partial_out,
        partial_lse,
        softmax_scale * _LOG2_E,
        seq_end,
        seq_begin,
        token_begin,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        NUM_SPLITS=num_splits,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        **tiles,
    )
    if num_splits > 1:
        assert token_begin == 0, "only the leading decode requests are split"
        _merge_splits_kernel[(token_end, num_heads)](
            partial_out,
            partial_lse,
            out,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=tiles["HEAD_DIM_PAD"],
            NUM_SPLITS=num_splits,
        )


def warm_up(
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    max_num_seqs: int,
    max_blocks: int,
) -> list[str]:
    """Compile, at start-up, every attention variant serving can launch: prefill tiles,
    decode tiles, and each split-KV count ``default_num_splits`` can pick for this model
    (with its merge kernel). Runs each once on a tiny batch; returns their names."""
    cache = torch.zeros(2, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    table = torch.zeros(2, 1, dtype=torch.int32, device=device)
    seq_lens = torch.ones(2, dtype=torch.int32, device=device)
    q = torch.zeros(3, num_heads, head_dim, dtype=dtype, device=device)
    names = []
    # A decode request then a two-token one: one decode and one prefill launch.
    mixed_cu = torch.tensor([0, 1, 3], dtype=torch.int32, device=device)
    paged_attention(q, cache, cache, table, seq_lens + 1, mixed_cu, 1.0, num_decodes=1)
    names += ["decode", "prefill"]
    decode_cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
    for splits in split_counts(device, num_kv_heads, max_num_seqs, max_blocks * block_size):
        if splits > 1:
            paged_attention(q[:2], cache, cache, table, seq_lens, decode_cu, 1.0, num_splits=splits)
            names.append(f"decode split {splits}")
    return names

"""Plain-torch definitions of the kernels' maths, with the same signatures as the Triton ops.

These are the single definition of paged attention: the tests hold the Triton kernels to them,
and the engine's CPU path calls them directly, so they are written to be clear first and
reasonably fast on a CPU second (the decode step, the hot case, is one batched matmul).

Layouts:
  key/value, q/out:  [num_tokens, heads, head_dim]
  k_cache/v_cache:   [num_blocks, block_size, num_kv_heads, head_dim]
  block_tables:      [num_seqs, max_blocks] (entries past a request's last block are ignored)
  seq_lens:          [num_seqs] tokens in the cache per request, this step's included
  cu_seqlens_q:      [num_seqs + 1] offsets of each request's queries in q
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["paged_attention", "store_kv"]

# How many length groups the decode requests of one call are split into (fewer if fewer requests).
DECODE_GROUPS = 4


FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
"""KV-cache dtypes held at one byte (``--kv-cache-dtype fp8``); read back as fp32 like the rest."""


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write each token's K/V row into the cache at ``slot = block_id * block_size + offset``.

    Slot -1 marks a padding token and is skipped. The caches are updated in place.
    """
    slots = slot_mapping.long()
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    for source, cache in ((key, k_cache), (value, v_cache)):
        # Rounding to fp8 saturates at the format's largest value (no infinities in e4m3).
        source = source.to(cache.dtype)
        if cache.dtype in FP8_DTYPES:
            # CPU index_copy_ has no fp8 kernel: the same bytes, copied as uint8.
            source, cache = source.view(torch.uint8), cache.view(torch.uint8)
        if cache.is_contiguous():
            # The cache as one row per slot: a row copy per token (index_copy_) rather than
            # a two-index scatter, several times faster on the CPU.
            cache.view(-1, cache.shape[2] * cache.shape[3]).index_copy_(
                0, slots, source.reshape(len(slots), -1)
            )
        else:
            block_size = cache.shape[1]
            cache[slots // block_size, slots % block_size] = source


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    softmax_scale: float,
    *,
    num_decodes: int | None = None,
) -> torch.Tensor:
    """Causal attention of packed varlen queries over keys/values read through block tables.

    Request i owns queries ``q[cu_seqlens_q[i]:cu_seqlens_q[i+1]]``; they are the last tokens
    of its ``seq_lens[i]`` cached tokens, so query j sits at absolute position
    ``seq_lens[i] - q_len + j`` and sees keys ``0..that position``. Query heads are grouped
    over KV heads (GQA): query head h reads KV head ``h // (num_heads // num_kv_heads)``.
    Scores and softmax are computed in fp32; the output has q's dtype. ``num_decodes`` (how
    many leading requests have one query, a launch hint for the Triton kernel) is not needed
    here: this function reads the query lengths itself.
    """
    num_tokens, num_heads = q.shape[:2]
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out

    starts = cu_seqlens_q[:-1].tolist()
    ends = cu_seqlens_q[1:].tolist()
    lens = seq_lens.tolist()
    decode_seqs = [i for i, (s, e) in enumerate(zip(starts, ends, strict=True)) if e - s == 1]
    # Decode requests run in a few groups of similar length, each padded only to its own
    # longest, rather than all padded to the batch's longest: far fewer blocks to gather and
    # attend over when lengths are spread (bench/engine_throughput.py: a quarter less time here).
    decode_seqs.sort(key=lens.__getitem__)
    num_groups = min(DECODE_GROUPS, len(decode_seqs))
    for g in range(num_groups):
        group = decode_seqs[
            g * len(decode_seqs) // num_groups : (g + 1) * len(decode_seqs) // num_groups
        ]
        # Indices and lengths from the host lists: index_select/index_copy_ over small
        # tensors, not advanced indexing (which costs several times more per call on the CPU).
        rows = torch.tensor([starts[i] for i in group], device=q.device)
        out.index_copy_(
            0,
            rows,
            _decode(
                q.index_select(0, rows),
                k_cache,
                v_cache,
                block_tables.index_select(0, torch.tensor(group, device=q.device)),
                torch.tensor([lens[i] for i in group], device=q.device),
                lens[group[-1]],
                softmax_scale,
            ),
        )
    for i, (start, end) in enumerate(zip(starts, ends, strict=True)):
        if end - start > 1:
            out[start:end] = prefill_one(
                q[start:end], k_cache, v_cache, block_tables[i], lens[i], softmax_scale
            )
    return out


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    softmax_scale: float,
) -> torch.Tensor:
    """One query per request: gather all requests' blocks padded to the longest, mask, one SDPA.

    The query heads sharing a KV head become SDPA's query length, so K/V are never repeated.
    """
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_blocks = -(-max_seq_len // block_size)
    # Table entries past a request's length may hold any filler (often -1); they are masked.
    tables = block_tables[:, :num_blocks].reshape(-1).long().clamp(min=0)
    keys = _gather(k_cache, tables).view(batch, num_blocks * block_size, num_kv_heads, head_dim)
    values = _gather(v_cache, tables).view(batch, num_blocks * block_size, num_kv_heads, head_dim)

    positions = torch.arange(keys.shape[1], device=q.device)
    visible = positions[None, :] < seq_lens[:, None].to(q.device)
    # Slots past a request's end may hold anything, NaN included, which a mask does not
    # neutralise (NaN - inf and 0 * NaN are NaN), so they are zeroed: whole rows of the
    # gathered K/V by index (index_fill_), several times cheaper on the CPU than a
    # broadcast masked_fill_ or an index_put of zeros.
    hidden = (~visible).view(-1).nonzero().view(-1)
    keys.view(-1, num_kv_heads * head_dim).index_fill_(0, hidden, 0.0)
    values.view(-1, num_kv_heads * head_dim).index_fill_(0, hidden, 0.0)
    out = F.scaled_dot_product_attention(
        q.float().view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=visible[:, None, None, :],
        scale=softmax_scale,
    )
    return out.reshape(batch, num_heads, head_dim).to(q.dtype)


def prefill_one(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    softmax_scale: float,
) -> torch.Tensor:
    """Several queries of one request: gather its keys contiguously and run SDPA causally.

    The causal mask is bottom-right aligned (the queries are the last tokens), which SDPA's
    ``is_causal`` matches only when there is no cached prefix, so otherwise it is explicit.
    """
    q_len = q.shape[0]
    block_size = k_cache.shape[1]
    table = block_table[: -(-seq_len // block_size)].long()
    keys = _gather(k_cache, table).flatten(0, 1)[:seq_len]
    values = _gather(v_cache, table).flatten(0, 1)[:seq_len]

    visible = None
    if q_len != seq_len:
        query_positions = torch.arange(seq_len - q_len, seq_len, device=q.device)
        key_positions = torch.arange(seq_len, device=q.device)
        visible = key_positions[None, :] <= query_positions[:, None]
    # A leading batch dimension of one: given 3-D inputs, SDPA on the CPU takes its math
    # path (a materialised score matrix), several times slower than its flash kernel.
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None],
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        attn_mask=visible,
        is_causal=visible is None,
        scale=softmax_scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1).to(q.dtype)


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """A fresh fp32 copy of the given cache blocks (softmax maths stays fp32 for fp16/bf16)."""
    return cache.index_select(0, blocks).float()

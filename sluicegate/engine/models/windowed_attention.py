"""Paged attention with a sliding window and/or attention-logit soft-capping, in plain torch.

The shared kernels (``sluicegate.kernels.reference`` and the Triton ops) attend to a request's whole
context with plain softmax(q·k·scale). Some transformers models need more: Gemma-2 caps the
logits with ``softcap * tanh(x / softcap)`` before the mask, and layers with a sliding window
see only the last ``window`` keys (key position > query position - window, transformers'
definition). This is that maths over the same cache layout and arguments, one request at a
time, in float32 like the reference; it runs on any device, and the transformers backend
calls it only when a cap or a window that the context actually exceeds is in play.
"""

from __future__ import annotations

import torch


def windowed_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    softmax_scale: float,
    *,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``sluicegate.kernels.reference.paged_attention`` plus an optional window and logit cap."""
    num_heads = q.shape[1]
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts = cu_seqlens_q[:-1].tolist()
    ends = cu_seqlens_q[1:].tolist()
    for i, (start, end, seq_len) in enumerate(zip(starts, ends, seq_lens.tolist(), strict=True)):
        q_len = end - start
        if q_len == 0:
            continue
        first_query = seq_len - q_len
        first_key = 0 if sliding_window is None else max(0, first_query - sliding_window + 1)
        first_block = first_key // block_size
        table = block_tables[i, first_block : -(-seq_len // block_size)].long()
        offset = first_key - first_block * block_size
        length = seq_len - first_key
        keys = k_cache.index_select(0, table).flatten(0, 1)[offset : offset + length].float()
        values = v_cache.index_select(0, table).flatten(0, 1)[offset : offset + length].float()

        # [kv_heads, group, q_len, head_dim] against [kv_heads, 1, head_dim, keys]
        queries = q[start:end].float().view(q_len, num_kv_heads, group, head_dim)
        scores = queries.permute(1, 2, 0, 3) @ keys.permute(1, 2, 0)[:, None] * softmax_scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        query_pos = torch.arange(first_query, seq_len, device=q.device)[:, None]
        key_pos = torch.arange(first_key, seq_len, device=q.device)[None, :]
        visible = key_pos <= query_pos
        if sliding_window is not None:
            visible &= key_pos > query_pos - sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        attended = probs @ values.permute(1, 0, 2)[:, None]
        out[start:end] = (
            attended.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim).to(q.dtype)
        )
    return out

"""Our paged attention as a transformers attention function.

Registered in transformers' ``AttentionInterface`` under ``ATTENTION_NAME``; a model whose
``_attn_implementation`` names it calls ``paged_attention_forward`` from every attention layer.
That function writes the layer's K/V into the engine's block pool and reads it back with paged
attention, taking the step's slot mapping, block tables and sequence lengths from the forward
context the model wrapper sets up around each step. transformers builds no mask for an
implementation it has no mask function for, and no cache is passed, so the block pool is the
only KV state.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sluicegate.engine.models.windowed_attention import windowed_paged_attention
from sluicegate.engine.runner.attention import AttentionMetadata


class UnsupportedTransformersModelError(ValueError):
    """The checkpoint's transformers class cannot run on the block pool; the message says why."""


ATTENTION_NAME = "sluicegate_paged"


class PagedKVLayer:
    """One attention layer's views into the block pool (assigned by the model runner)."""

    def __init__(self) -> None:
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)


@dataclass
class ForwardContext:
    meta: AttentionMetadata
    layers: list[PagedKVLayer]
    max_seq_len: int


# A context variable rather than a global: two engines stepping in two threads each see
# their own step's metadata.
_context: ContextVar[ForwardContext | None] = ContextVar("sluicegate_forward", default=None)


@contextlib.contextmanager
def forward_context(context: ForwardContext) -> Iterator[None]:
    token = _context.set(context)
    try:
        yield
    finally:
        _context.reset(token)


def paged_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: q/k/v are [1, heads, tokens, head_dim] (all of the
    step's requests packed into one row); returns [1, tokens, heads, head_dim]."""
    context = _context.get()
    if context is None:
        raise RuntimeError(
            f"{type(module).__name__} ran outside the engine's forward: the block pool is unset"
        )
    if not getattr(module, "is_causal", True):
        raise UnsupportedTransformersModelError(
            f"{type(module).__name__} is not causal; the block pool only serves causal attention"
        )
    layer = context.layers[module.layer_idx]
    meta = context.meta
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    scale = scaling if scaling is not None else module.head_dim**-0.5
    meta.backend.store_kv(k, v, layer.k_cache, layer.v_cache, meta.slot_mapping)
    window_in_effect = sliding_window is not None and context.max_seq_len > sliding_window
    if softcap or window_in_effect:
        out = windowed_paged_attention(
            q,
            layer.k_cache,
            layer.v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.cu_seqlens_q,
            scale,
            sliding_window=sliding_window if window_in_effect else None,
            softcap=softcap or None,
        )
    else:
        out = meta.backend.paged_attention(
            q.contiguous(),
            layer.k_cache,
            layer.v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.cu_seqlens_q,
            scale,
        )
    return out.unsqueeze(0), None


def register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)

"""Paged attention layer and the choice of backend behind it.

Two backends share one interface (``store_kv`` + ``paged_attention`` with the signatures of
``kernels.reference``): ``triton`` (the kernels package; default on CUDA, and usable on CPU
tensors under ``TRITON_INTERPRET=1``) and ``torch`` (``kernels.reference``, default on CPU).
An explicit engine option wins over ``SLUICEGATE_ATTENTION_BACKEND``, which wins over the
device default.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

BACKENDS = ("triton", "torch")
BACKEND_ENV = "SLUICEGATE_ATTENTION_BACKEND"


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    store_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]


def resolve_backend_name(requested: str | None, device: torch.device) -> str:
    name = (
        requested or os.environ.get(BACKEND_ENV) or ("triton" if device.type == "cuda" else "torch")
    )
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKENDS}")
    return name


def load_backend(requested: str | None, device: torch.device) -> AttentionBackend:
    name = resolve_backend_name(requested, device)
    if name == "triton":
        import kernels

        return AttentionBackend(name, kernels.store_kv, kernels.paged_attention)
    from kernels import reference

    return AttentionBackend(name, reference.store_kv, reference.paged_attention)


@dataclass
class Partition:
    """A subset of the step's requests, attended in one backend call."""

    rows: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each request's queries may see.

    ``partitions`` (torch backend only) splits the step into calls of the same backend:
    the reference pads every decode to the longest one in its call, so decodes are grouped by
    similar length, which on a CPU cuts the K/V bytes gathered per step by up to half.
    """

    backend: AttentionBackend
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    partitions: list[Partition] | None = None


DECODE_GROUP_SIZE = 16


def partition_by_length(
    query_lens: list[int], seq_lens: list[int], tables: list[list[int]], device: torch.device
) -> list[Partition] | None:
    """Decodes sorted by length in groups of ``DECODE_GROUP_SIZE``, plus one partition
    with every multi-token request; None when a single call would do as well."""
    decodes = sorted((i for i, n in enumerate(query_lens) if n == 1), key=seq_lens.__getitem__)
    if len(decodes) <= DECODE_GROUP_SIZE:
        return None
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    groups = [decodes[i : i + DECODE_GROUP_SIZE] for i in range(0, len(decodes), DECODE_GROUP_SIZE)]
    prefills = [i for i, n in enumerate(query_lens) if n > 1]
    if prefills:
        groups.append(prefills)
    partitions = []
    for group in groups:
        rows = [r for i in group for r in range(starts[i], starts[i + 1])]
        cu = [0]
        for i in group:
            cu.append(cu[-1] + query_lens[i])
        width = max(len(tables[i]) for i in group)
        partitions.append(
            Partition(
                rows=torch.tensor(rows, dtype=torch.long, device=device),
                block_tables=torch.tensor(
                    [tables[i] + [0] * (width - len(tables[i])) for i in group],
                    dtype=torch.int32,
                    device=device,
                ),
                seq_lens=torch.tensor(
                    [seq_lens[i] for i in group], dtype=torch.int32, device=device
                ),
                cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
            )
        )
    return partitions


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

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        meta.backend.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        if meta.partitions is not None:
            out = torch.empty_like(q)
            for part in meta.partitions:
                out[part.rows] = meta.backend.paged_attention(
                    q[part.rows],
                    self.k_cache,
                    self.v_cache,
                    part.block_tables,
                    part.seq_lens,
                    part.cu_seqlens_q,
                    self.scale,
                )
            return out
        return meta.backend.paged_attention(
            q,
            self.k_cache,
            self.v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.cu_seqlens_q,
            self.scale,
        )

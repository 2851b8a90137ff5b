"""Paged attention on the CPU with a compiled decode kernel (``csrc/paged_decode.cpp``).

The torch reference (``kernels.reference``) decodes by gathering every request's blocks into
one padded fp32 copy and running SDPA over it; on a CPU that copy is most of the step's
attention time. The C++ kernel reads keys and values in place through the block table, one
task per (request, KV head), and is several times faster on decode batches
(``bench/cpu_decode.py``). Prefill rows still go through the reference (SDPA's flash
kernel). Same signatures as ``kernels.reference``, float32 CPU tensors only (others take the
reference whole).

The kernel is part of the CPU kernels' extension (``kernels.cpu_build``), built on first use;
without a C++ compiler ``available()`` says no and the engine keeps the torch backend.
"""

from __future__ import annotations

import torch

from kernels import cpu_ops, reference
from kernels.cpu_build import extension

__all__ = ["available", "paged_attention", "store_kv"]


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """``kernels.reference.store_kv``; row copies in C++ for float32 caches."""
    if (
        cpu_ops.supports(key)
        and k_cache.dtype == torch.float32
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    ):
        cpu_ops.store_kv(key, value, k_cache, v_cache, slot_mapping)
    else:
        reference.store_kv(key, value, k_cache, v_cache, slot_mapping)


def available() -> bool:
    """Whether the compiled decode kernel could be built (builds it on first call)."""
    return extension() is not None


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
    """``kernels.reference.paged_attention``, its one-query rows by the compiled kernel."""
    kernels = extension()
    if (
        kernels is None
        or q.device.type != "cpu"
        or k_cache.dtype != torch.float32
        or q.dtype != torch.float32
    ):
        return reference.paged_attention(
            q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, softmax_scale
        )
    num_tokens = q.shape[0]
    num_seqs = seq_lens.shape[0]
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    if num_tokens == num_seqs:
        # One query per request: all decodes (the common step), no reordering.
        return kernels.paged_decode(q.contiguous(), k_cache, v_cache, tables, lens, softmax_scale)
    out = torch.empty_like(q)
    starts = cu_seqlens_q[:-1].tolist()
    ends = cu_seqlens_q[1:].tolist()
    decodes = [i for i, (s, e) in enumerate(zip(starts, ends, strict=True)) if e - s == 1]
    if decodes:
        seqs = torch.tensor(decodes)
        rows = torch.tensor([starts[i] for i in decodes])
        decoded = kernels.paged_decode(
            q.index_select(0, rows),
            k_cache,
            v_cache,
            tables.index_select(0, seqs),
            lens.index_select(0, seqs),
            softmax_scale,
        )
        out.index_copy_(0, rows, decoded)
    lengths = lens.tolist()
    for i, (start, end) in enumerate(zip(starts, ends, strict=True)):
        if end - start > 1:
            out[start:end] = reference.prefill_one(
                q[start:end], k_cache, v_cache, block_tables[i], lengths[i], softmax_scale
            )
    return out

"""Paged attention on the CPU with compiled kernels: ``csrc/attention/paged_decode.cpp`` for one-query
rows, ``csrc/attention/paged_prefill.cpp`` for requests with several queries (prompts and their chunks).

The torch reference (``sluicegate.kernels.reference``) gathers every request's blocks into a contiguous
fp32 copy and runs SDPA over it; on a CPU those copies are most of the attention time. The
C++ kernels read keys and values in place through the block table (``bench/cpu_decode.py``).
Same signatures as ``sluicegate.kernels.reference``, for CPU tensors of float32, bfloat16 or float16
(others take the reference whole; prefill rows of a head_dim or block size that is not a
multiple of 16 too). Decode rows take 16-float AVX-512 registers where the CPU has them and
head_dim is a multiple of 16, else 8-float AVX2 ones. A 16-bit cache is read as it is stored and widened to float32 in
registers, so scores, softmax and the weighted sum are float32 as in the reference, which
gathers a float32 copy first. The queries are read in their own dtype, as a view into the
fused q/k/v product (no copy), and the output is written in it: widening and rounding per
task gives the bits the reference's conversions would, without two whole-tensor conversions
per layer, each a parallel region that cost more than it converted (SmolLM2 in bfloat16,
64 decode rows: ~9 % of a step).

The kernel is part of the CPU kernels' extension (``sluicegate.kernels.cpu_build``), built on first use;
without a C++ compiler ``available()`` says no and the engine keeps the torch backend.
"""

from __future__ import annotations

from types import ModuleType

import torch

from sluicegate.kernels import cpu_ops, reference
from sluicegate.kernels.cpu_build import extension

__all__ = ["allow_avx512", "available", "paged_attention", "store_kv"]


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """``sluicegate.kernels.reference.store_kv``; row copies in C++ where key, value and cache
    share a dtype (float32, bfloat16 or float16)."""
    if (
        cpu_ops.supports(key)
        and key.dtype == value.dtype == k_cache.dtype == v_cache.dtype
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
    ):
        cpu_ops.store_kv(key, value, k_cache, v_cache, slot_mapping)
    else:
        reference.store_kv(key, value, k_cache, v_cache, slot_mapping)


def available() -> bool:
    """Whether the compiled decode kernel could be built (builds it on first call)."""
    return extension() is not None


def allow_avx512(allow: bool) -> bool:
    """Let the decode and prefill kernels use their AVX-512 paths where the CPU has it (on by
    default; tests and benches turn them off to run the AVX2 ones); returns the previous
    setting (the decode kernel's)."""
    kernels = extension()
    assert kernels is not None, "check available() first"
    kernels.paged_prefill_allow_avx512(allow)
    return bool(kernels.paged_decode_allow_avx512(allow))


def allow_bf16_dots(allow: bool) -> bool:
    """Let the prefill kernel take bfloat16 queries' scores on the CPU's bfloat16 dot products
    (AVX512_BF16) where it has them (on by default; tests and benches turn it off to run the
    float32 tiles); returns the previous setting."""
    kernels = extension()
    assert kernels is not None, "check available() first"
    return bool(kernels.paged_prefill_allow_bf16_dots(allow))


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
    """``sluicegate.kernels.reference.paged_attention``, its one-query rows by the compiled kernel."""
    kernels = extension()
    if (
        kernels is None
        or q.device.type != "cpu"
        or k_cache.dtype not in cpu_ops.DTYPES
        or v_cache.dtype != k_cache.dtype
        or q.dtype not in cpu_ops.DTYPES
    ):
        return reference.paged_attention(
            q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, softmax_scale
        )
    if q.stride(-1) != 1 or q.stride(-2) != q.shape[-1]:
        q = q.contiguous()
    return _attention(
        kernels, q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, softmax_scale
    )


def _attention(
    kernels: ModuleType,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    num_tokens = q.shape[0]
    num_seqs = seq_lens.shape[0]
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    if num_tokens == num_seqs:
        # One query per request: all decodes (the common step), no reordering.
        return kernels.paged_decode(q, k_cache, v_cache, tables, lens, softmax_scale)
    out = torch.empty(q.shape, dtype=q.dtype)
    starts = cu_seqlens_q[:-1].tolist()
    ends = cu_seqlens_q[1:].tolist()
    decodes = [i for i, (s, e) in enumerate(zip(starts, ends, strict=True)) if e - s == 1]
    prefills = [i for i, (s, e) in enumerate(zip(starts, ends, strict=True)) if e - s > 1]
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
    if not prefills:
        return out
    if kernels.paged_prefill_supported(q.shape[2], k_cache.shape[1]):
        kernels.paged_prefill(
            q,
            k_cache,
            v_cache,
            tables,
            lens,
            cu_seqlens_q.to(torch.int32).contiguous(),
            torch.tensor(prefills, dtype=torch.int64),
            softmax_scale,
            out,
        )
        return out
    lengths = lens.tolist()
    for i in prefills:
        out[starts[i] : ends[i]] = reference.prefill_one(
            q[starts[i] : ends[i]], k_cache, v_cache, block_tables[i], lengths[i], softmax_scale
        )
    return out

"""Builders for paged-attention test cases, shared by the reference and Triton kernel tests.

A case starts from each request's dense K/V sequence, scatters it into a paged cache through a
shuffled block table (by plain Python indexing, independent of any code under test), and keeps
the dense copy so results can also be checked against naive attention.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

# (seq_len, q_len) per request, for block size 16 or 32: a 1-token decode, a fresh prefill,
# a chunk of a prompt whose first part is already cached, and a length that is an exact
# multiple of the block size (decode and chunk both end exactly at a block boundary).
RAGGED_SPECS = {
    16: [(37, 1), (20, 20), (45, 13), (32, 1), (48, 7)],
    32: [(37, 1), (20, 20), (75, 13), (64, 1), (96, 7)],
}

# Worst-case absolute/relative error allowed against the reference, per dtype.
TOLERANCES = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-4},
    torch.float16: {"atol": 4e-3, "rtol": 4e-3},
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
}


@dataclass
class PagedCase:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    softmax_scale: float
    dense_keys: list[torch.Tensor]
    dense_values: list[torch.Tensor]

    def args(self) -> tuple:
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.seq_lens,
            self.cu_seqlens_q,
            self.softmax_scale,
        )


def build_paged_case(
    specs: Sequence[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    spare_blocks: int = 3,
    device: str = "cpu",
) -> PagedCase:
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-seq_len // block_size) for seq_len, _ in specs]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    max_blocks = max(blocks_per_seq) + 1
    # Unwritten cache slots hold NaN so any read of one that is not masked out shows up.
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    block_tables = torch.full((len(specs), max_blocks), -1, dtype=torch.int32)
    order = torch.randperm(num_blocks, generator=generator).tolist()

    dense_keys, dense_values, queries = [], [], []
    for seq, (seq_len, q_len) in enumerate(specs):
        table = [order.pop() for _ in range(blocks_per_seq[seq])]
        block_tables[seq, : len(table)] = torch.tensor(table, dtype=torch.int32)
        keys = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator).to(dtype)
        values = torch.randn(seq_len, num_kv_heads, head_dim, generator=generator).to(dtype)
        for position in range(seq_len):
            block, offset = table[position // block_size], position % block_size
            k_cache[block, offset] = keys[position].float()
            v_cache[block, offset] = values[position].float()
        dense_keys.append(keys)
        dense_values.append(values)
        queries.append(torch.randn(q_len, num_heads, head_dim, generator=generator))

    q_lens = torch.tensor([q_len for _, q_len in specs])
    cu_seqlens_q = torch.zeros(len(specs) + 1, dtype=torch.int32)
    cu_seqlens_q[1:] = torch.cumsum(q_lens, 0)
    return PagedCase(
        q=torch.cat(queries).to(dtype).to(device),
        k_cache=k_cache.to(dtype).to(device),
        v_cache=v_cache.to(dtype).to(device),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor([s for s, _ in specs], dtype=torch.int32, device=device),
        cu_seqlens_q=cu_seqlens_q.to(device),
        softmax_scale=head_dim**-0.5,
        dense_keys=[k.to(device) for k in dense_keys],
        dense_values=[v.to(device) for v in dense_values],
    )


def dense_attention(case: PagedCase) -> torch.Tensor:
    """Textbook causal attention in float64 on each request's contiguous K/V (no paging)."""
    group = case.q.shape[1] // case.k_cache.shape[2]
    outputs = []
    bounds = case.cu_seqlens_q.tolist()
    for seq, (start, end) in enumerate(itertools.pairwise(bounds)):
        q = case.q[start:end].double()
        keys = case.dense_keys[seq].double().repeat_interleave(group, dim=1)
        values = case.dense_values[seq].double().repeat_interleave(group, dim=1)
        seq_len, q_len = keys.shape[0], end - start
        scores = torch.einsum("qhd,khd->hqk", q, keys) * case.softmax_scale
        query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        key_pos = torch.arange(seq_len, device=q.device)[None, :]
        scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
        outputs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), values))
    return torch.cat(outputs)


@pytest.fixture
def make_paged_case() -> Callable[..., PagedCase]:
    return build_paged_case


@pytest.fixture
def naive_attention() -> Callable[[PagedCase], torch.Tensor]:
    return dense_attention


@pytest.fixture
def ragged_specs() -> dict[int, list[tuple[int, int]]]:
    return RAGGED_SPECS


@pytest.fixture
def tolerances() -> dict[torch.dtype, dict[str, float]]:
    return TOLERANCES


def _cpu_has(flag: str) -> bool:
    try:
        return f" {flag} " in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@pytest.fixture(params=["avx512", "avx2"])
def cpu_isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """The CPU kernels' AVX-512 paths (attention, RMSNorm and SiLU x mul) where the CPU has
    them, and their AVX2 paths; the prefill's bfloat16 dot products off (``bf16_dots``)."""
    if request.param == "avx512" and not _cpu_has("avx512f"):
        pytest.skip("this CPU has no AVX-512")
    from sluicegate.kernels import cpu_attention, cpu_ops

    allow = request.param == "avx512"
    previous = cpu_attention.allow_avx512(allow), cpu_ops.allow_avx512(allow)
    dots = cpu_attention.allow_bf16_dots(False)
    yield request.param
    cpu_attention.allow_avx512(previous[0])
    cpu_ops.allow_avx512(previous[1])
    cpu_attention.allow_bf16_dots(dots)


@pytest.fixture
def bf16_dots() -> Iterator[None]:
    """The prefill kernel's scores on AVX512_BF16's dot products (bfloat16 queries and cache)."""
    if not _cpu_has("avx512_bf16"):
        pytest.skip("this CPU has no AVX512_BF16")
    from sluicegate.kernels import cpu_attention

    previous = cpu_attention.allow_avx512(True), cpu_attention.allow_bf16_dots(True)
    yield
    cpu_attention.allow_avx512(previous[0])
    cpu_attention.allow_bf16_dots(previous[1])

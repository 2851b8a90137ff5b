"""The CPU backend's compiled attention kernels against the torch reference and naive
attention, for float32, bfloat16 and float16 caches."""

from __future__ import annotations

import pytest
import torch

from sluicegate.kernels import cpu_attention, reference

pytestmark = pytest.mark.skipif(
    not cpu_attention.available(), reason="the C++ decode kernel needs a C++ compiler"
)


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _assert_matches_reference(case, tolerances) -> torch.Tensor:
    out = cpu_attention.paged_attention(*case.args())
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    torch.testing.assert_close(
        out, reference.paged_attention(*case.args()), **tolerances[case.q.dtype]
    )
    if case.q.dtype != torch.float32:
        # Float32 queries over the same 16-bit cache: both sides widen the cache's values to
        # float32 (the reference in a gathered copy, the kernel as it loads them) and compute
        # in float32, so they agree to float32's tolerance, not just to the dtype's rounding.
        args = (case.q.float(), *case.args()[1:])
        wide = cpu_attention.paged_attention(*args)
        assert wide.dtype == torch.float32
        torch.testing.assert_close(
            wide, reference.paged_attention(*args), **tolerances[torch.float32]
        )
        # Read in their own dtype, 16-bit queries give the bits of widening them first and
        # rounding the float32 result.
        assert torch.equal(out, wide.to(case.q.dtype))
    # Queries as a view into a wider product (the fused q/k/v rows), read in place.
    width = case.q[0].numel()
    fused = torch.zeros(case.q.shape[0], width + 40, dtype=case.q.dtype)
    fused[:, :width] = case.q.flatten(1)
    view = fused[:, :width].view(case.q.shape)
    assert not view.is_contiguous()
    assert torch.equal(cpu_attention.paged_attention(view, *case.args()[1:]), out)
    return out


@pytest.mark.parametrize("head_dim", [64, 128, 80, 36])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads", [(4, 4), (8, 2), (14, 2)], ids=["mha", "gqa4", "gqa7"]
)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ragged_batch_matches_reference(
    cpu_isa,
    make_paged_case,
    ragged_specs,
    tolerances,
    head_dim,
    num_heads,
    num_kv_heads,
    block_size,
    dtype,
) -> None:
    case = make_paged_case(
        ragged_specs[block_size], num_heads, num_kv_heads, head_dim, block_size, dtype=dtype
    )
    _assert_matches_reference(case, tolerances)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_decode_batch_matches_naive_attention(
    cpu_isa, make_paged_case, naive_attention, tolerances, block_size, dtype
) -> None:
    # Every request one query (the step the kernel takes whole), lengths on and off block
    # boundaries, one of a single token.
    specs = [(1, 1), (block_size, 1), (block_size + 1, 1), (3 * block_size - 1, 1), (90, 1)]
    case = make_paged_case(specs, 8, 2, 64, block_size, dtype=dtype, seed=3)
    out = _assert_matches_reference(case, tolerances)
    torch.testing.assert_close(out.double(), naive_attention(case), **tolerances[dtype])


@pytest.mark.parametrize("batch", [2, 8, 24], ids=lambda b: f"batch{b}")
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim", [(9, 3, 64), (14, 2, 128), (8, 4, 64)], ids=str
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_spans_of_kv_heads_match_naive_attention(
    cpu_isa,
    make_paged_case,
    naive_attention,
    tolerances,
    batch,
    num_heads,
    num_kv_heads,
    head_dim,
    dtype,
) -> None:
    # On two threads a task takes one KV head of two requests, spans of two (and a shorter
    # last span of three heads) at 8 requests, and every head of a request at 24; lengths
    # under one tile of four keys, under one pass of 16 value rows, and past several.
    lengths = [1, 3, 16, 17, 45, 70, 130, 5]
    specs = [(lengths[i % len(lengths)], 1) for i in range(batch)]
    case = make_paged_case(specs, num_heads, num_kv_heads, head_dim, 16, dtype=dtype, seed=5)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = _assert_matches_reference(case, tolerances)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(out.double(), naive_attention(case), **tolerances[dtype])


def test_table_entries_past_the_end_are_never_read(make_paged_case, tolerances) -> None:
    case = make_paged_case([(20, 1), (37, 1)], 8, 2, 64, 16)
    tables = case.block_tables.clone()
    tables[0, 2:] = -1  # the 20-token request owns two blocks; the rest is filler
    case.block_tables = tables
    _assert_matches_reference(case, tolerances)


def test_other_dtypes_take_the_reference(make_paged_case, ragged_specs) -> None:
    case = make_paged_case(ragged_specs[16], 8, 2, 64, 16, dtype=torch.float64)
    out = cpu_attention.paged_attention(*case.args())
    assert torch.equal(out, reference.paged_attention(*case.args()))
    # Caches of two dtypes are no layout the kernels read.
    case = make_paged_case(ragged_specs[16], 8, 2, 64, 16, dtype=torch.bfloat16)
    args = list(case.args())
    args[2] = args[2].half()
    out = cpu_attention.paged_attention(*args)
    assert torch.equal(out, reference.paged_attention(*args))


PREFILL_SPECS = [(150, 150), (187, 150), (45, 9), (70, 1), (33, 33)]
"""The prefill kernel's tiles: a fresh prompt of several 16-position tiles, a chunk after a
cached prefix that ends mid-block, one shorter than a tile, beside a decode row."""


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim",
    [(8, 2, 64), (14, 2, 128), (4, 4, 80), (9, 3, 64)],
    ids=str,
)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_long_prefills_match_naive_attention(
    cpu_isa,
    make_paged_case,
    naive_attention,
    tolerances,
    block_size,
    num_heads,
    num_kv_heads,
    head_dim,
    dtype,
) -> None:
    case = make_paged_case(
        PREFILL_SPECS, num_heads, num_kv_heads, head_dim, block_size, dtype=dtype, seed=11
    )
    out = _assert_matches_reference(case, tolerances)
    torch.testing.assert_close(out.double(), naive_attention(case), **tolerances[dtype])


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim",
    [(8, 2, 64), (14, 2, 128), (4, 4, 80), (9, 3, 64)],
    ids=str,
)
def test_bf16_prefills_on_dot_products_match_naive_attention(
    bf16_dots,
    make_paged_case,
    naive_attention,
    tolerances,
    block_size,
    num_heads,
    num_kv_heads,
    head_dim,
) -> None:
    # The same prompts, chunks and decode row as above, the scores summed in pairs of d on
    # the dot products, keys read from the cache in place (a chunk's last keys from a zero row).
    # Not bit for bit the float32 tiles' result (their sums run one d at a time): within
    # bfloat16's rounding of the reference and of naive attention.
    case = make_paged_case(
        PREFILL_SPECS, num_heads, num_kv_heads, head_dim, block_size, dtype=torch.bfloat16, seed=11
    )
    out = cpu_attention.paged_attention(*case.args())
    assert out.dtype == torch.bfloat16 and out.shape == case.q.shape
    bf16 = tolerances[torch.bfloat16]
    torch.testing.assert_close(out, reference.paged_attention(*case.args()), **bf16)
    torch.testing.assert_close(out.double(), naive_attention(case), **bf16)
    previous = cpu_attention.allow_bf16_dots(False)
    try:
        tiles = cpu_attention.paged_attention(*case.args())
    finally:
        cpu_attention.allow_bf16_dots(previous)
    assert not torch.equal(out, tiles), "the dot products did not run"

"""The Triton paged-attention kernel against the torch reference and naive dense attention.

Runs under ``TRITON_INTERPRET=1`` on the CPU (tests/conftest.py sets it), so shapes are tiny;
the kernel upcasts to fp32 after loading there, which makes bf16 testable too.
"""

from __future__ import annotations

import os

import pytest
import torch

from sluicegate import kernels
from sluicegate.kernels import reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _assert_matches_reference(case, tolerances, **kwargs) -> torch.Tensor:
    out = kernels.paged_attention(*case.args(), **kwargs)
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    expected = reference.paged_attention(*case.args())
    torch.testing.assert_close(out, expected, **tolerances[case.q.dtype])
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 80])
@pytest.mark.parametrize(
    "num_heads,num_kv_heads", [(4, 4), (8, 2), (8, 1)], ids=["mha", "gqa4", "gqa8"]
)
@pytest.mark.parametrize("block_size", [16, 32])
def test_ragged_batch_matches_reference(
    make_paged_case, ragged_specs, tolerances, dtype, head_dim, num_heads, num_kv_heads, block_size
) -> None:
    case = make_paged_case(
        ragged_specs[block_size], num_heads, num_kv_heads, head_dim, block_size, dtype=dtype
    )
    _assert_matches_reference(case, tolerances)


@pytest.mark.parametrize("head_dim", [96, 256])
def test_other_head_dims_match_reference(
    make_paged_case, ragged_specs, tolerances, head_dim
) -> None:
    case = make_paged_case(ragged_specs[16], 4, 2, head_dim, 16, dtype=torch.float16)
    _assert_matches_reference(case, tolerances)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("block_size", [16, 32])
def test_matches_naive_dense_attention(
    make_paged_case, naive_attention, ragged_specs, tolerances, dtype, block_size
) -> None:
    case = make_paged_case(ragged_specs[block_size], 8, 2, 64, block_size, dtype=dtype, seed=7)
    out = kernels.paged_attention(*case.args())
    torch.testing.assert_close(out.double(), naive_attention(case), **tolerances[dtype])


def test_group_that_is_not_a_power_of_two(make_paged_case, ragged_specs, tolerances) -> None:
    # Qwen2-0.5B-like: 14 query heads over 2 KV heads.
    case = make_paged_case(ragged_specs[16], 14, 2, 64, 16, dtype=torch.float16)
    _assert_matches_reference(case, tolerances)


@pytest.mark.parametrize("specs", [[(40, 40)], [(33, 1)], [(50, 10)]], ids=str)
def test_single_request(make_paged_case, tolerances, specs) -> None:
    case = make_paged_case(specs, 8, 2, 64, 16)
    _assert_matches_reference(case, tolerances)


def test_long_prefill_spans_several_query_blocks(make_paged_case, tolerances) -> None:
    case = make_paged_case([(150, 140), (3, 3), (70, 1)], 4, 4, 64, 16, dtype=torch.float16)
    _assert_matches_reference(case, tolerances)


@pytest.mark.parametrize("num_splits", [2, 4, 8])
def test_split_kv_decode_matches_reference(make_paged_case, tolerances, num_splits) -> None:
    # The 5-token request leaves most of its splits empty; they must weigh nothing.
    specs = [(200, 1), (5, 1), (64, 1), (97, 1)]
    case = make_paged_case(specs, 8, 2, 64, 16, dtype=torch.float16, seed=num_splits)
    _assert_matches_reference(case, tolerances, num_splits=num_splits)


def test_split_kv_on_a_mixed_batch(make_paged_case, naive_attention, ragged_specs) -> None:
    case = make_paged_case(ragged_specs[32], 8, 4, 80, 32, seed=3)
    out = kernels.paged_attention(*case.args(), num_splits=4)
    torch.testing.assert_close(out.double(), naive_attention(case), atol=1e-4, rtol=1e-4)


def test_int64_metadata_and_strided_queries(make_paged_case, ragged_specs, tolerances) -> None:
    case = make_paged_case(ragged_specs[16], 4, 2, 64, 16)
    expected = reference.paged_attention(*case.args())
    # Queries as a view into a fused QKV buffer: token stride larger than heads * head_dim.
    fused = torch.zeros(case.q.shape[0], 8, 64)
    fused[:, :4] = case.q
    out = kernels.paged_attention(
        fused[:, :4],
        case.k_cache,
        case.v_cache,
        case.block_tables.long(),
        case.seq_lens.long(),
        case.cu_seqlens_q.long(),
        case.softmax_scale,
    )
    torch.testing.assert_close(out, expected, **tolerances[torch.float32])


def test_rejects_inconsistent_inputs(make_paged_case, ragged_specs) -> None:
    case = make_paged_case(ragged_specs[16], 4, 2, 64, 16)
    with pytest.raises(TypeError, match="must match"):
        kernels.paged_attention(case.q.half(), *case.args()[1:])
    with pytest.raises(ValueError, match="num_splits"):
        kernels.paged_attention(*case.args(), num_splits=3)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
    reason="needs a CUDA GPU with TRITON_INTERPRET=0",
)
@pytest.mark.parametrize("num_splits", [None, 1, 4])
def test_llama_shapes_bf16_on_gpu(make_paged_case, tolerances, num_splits) -> None:
    specs = [(1000, 1), (700, 700), (2100, 300), (1024, 1), (77, 1)]
    case = make_paged_case(specs, 32, 8, 128, 16, dtype=torch.bfloat16, device="cuda")
    _assert_matches_reference(case, tolerances, num_splits=num_splits)


@pytest.mark.parametrize("num_decodes", [0, 1, 2])
@pytest.mark.parametrize("num_splits", [None, 4])
def test_leading_decodes_take_the_decode_launch(
    make_paged_case, tolerances, num_decodes, num_splits
) -> None:
    """A mixed batch split into a decode launch (the leading one-token requests, split-KV
    when asked) and a prefill launch gives the same result whatever the hint."""
    specs = [(37, 1), (130, 1), (20, 20), (45, 13), (9, 1)]
    case = make_paged_case(specs, 8, 2, 64, 16, dtype=torch.float16, seed=num_decodes)
    _assert_matches_reference(case, tolerances, num_decodes=num_decodes, num_splits=num_splits)


def test_num_decodes_out_of_range_is_refused(make_paged_case, ragged_specs) -> None:
    case = make_paged_case(ragged_specs[16], 4, 2, 64, 16)
    with pytest.raises(ValueError, match="num_decodes"):
        kernels.paged_attention(*case.args(), num_decodes=len(ragged_specs[16]) + 1)


def test_warm_up_runs_every_variant_it_names() -> None:
    from sluicegate.kernels.triton_paged_attention import warm_up

    names = warm_up(
        num_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
        device=torch.device("cpu"),
        max_num_seqs=8,
        max_blocks=4,
    )
    # Split-KV only exists on a GPU (the launcher never splits elsewhere).
    assert names == ["decode", "prefill"]

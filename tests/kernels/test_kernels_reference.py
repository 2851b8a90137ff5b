"""The torch reference against naive dense attention and a per-token cache write."""

from __future__ import annotations

import pytest
import torch

from sluicegate.kernels import reference


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_paged_attention_matches_dense(
    make_paged_case, naive_attention, ragged_specs, block_size, num_heads, num_kv_heads, head_dim
) -> None:
    case = make_paged_case(
        ragged_specs[block_size], num_heads, num_kv_heads, head_dim, block_size, seed=head_dim
    )
    out = reference.paged_attention(*case.args())
    torch.testing.assert_close(out.double(), naive_attention(case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_attention_low_precision_matches_dense(
    make_paged_case, naive_attention, ragged_specs, tolerances, dtype
) -> None:
    case = make_paged_case(ragged_specs[16], 8, 2, 64, 16, dtype=dtype, seed=1)
    out = reference.paged_attention(*case.args())
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), naive_attention(case), **tolerances[dtype])


def test_pure_decode_batch_matches_dense(make_paged_case, naive_attention) -> None:
    specs = [(1, 1), (16, 1), (17, 1), (50, 1)]
    case = make_paged_case(specs, 8, 2, 64, 16, seed=2)
    out = reference.paged_attention(*case.args())
    torch.testing.assert_close(out.double(), naive_attention(case), atol=1e-5, rtol=1e-5)


def test_decodes_in_length_groups_match_dense(make_paged_case, naive_attention) -> None:
    # More decode requests than DECODE_GROUPS, unsorted, unevenly divisible, with a prefill
    # between them: each group is padded to its own longest over NaN-filled unwritten slots.
    specs = [(130, 1), (3, 1), (64, 1), (20, 20), (97, 1), (16, 1), (33, 1), (250, 1), (5, 1)]
    case = make_paged_case(specs, 8, 2, 64, 16, seed=3)
    out = reference.paged_attention(*case.args())
    assert len(specs) - 1 > reference.DECODE_GROUPS
    torch.testing.assert_close(out.double(), naive_attention(case), atol=1e-5, rtol=1e-5)


def test_empty_batch_returns_empty() -> None:
    k_cache = torch.zeros(2, 16, 2, 64)
    out = reference.paged_attention(
        torch.zeros(0, 4, 64),
        k_cache,
        k_cache.clone(),
        torch.zeros(0, 1, dtype=torch.int32),
        torch.zeros(0, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32),
        0.125,
    )
    assert out.shape == (0, 4, 64)


def test_store_kv_writes_slots_and_skips_padding() -> None:
    num_blocks, block_size, num_kv_heads, head_dim = 4, 16, 2, 64
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float16)
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(5, num_kv_heads, head_dim)
    value = torch.randn(5, num_kv_heads, head_dim)
    slot_mapping = torch.tensor([3, -1, 17, 63, -1])

    reference.store_kv(key, value, k_cache, v_cache, slot_mapping)

    expected_k, expected_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    for token, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            expected_k[slot // block_size, slot % block_size] = key[token].half()
            expected_v[slot // block_size, slot % block_size] = value[token].half()
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


def test_reference_import_leaves_triton_out() -> None:
    import subprocess
    import sys

    code = "import sys, sluicegate.kernels.reference; assert 'triton' not in sys.modules, 'triton loaded'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_paged_attention_leaves_the_cache_untouched(make_paged_case, ragged_specs) -> None:
    case = make_paged_case(ragged_specs[16], 4, 2, 64, 16)
    k_before, v_before = case.k_cache.clone(), case.v_cache.clone()
    reference.paged_attention(*case.args())
    assert torch.equal(case.k_cache.nan_to_num(), k_before.nan_to_num())
    assert torch.equal(case.v_cache.nan_to_num(), v_before.nan_to_num())

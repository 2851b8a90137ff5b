"""The Triton KV-cache write against the torch reference (interpreter on CPU, or a GPU)."""

from __future__ import annotations

import pytest
import torch

from sluicegate import kernels
from sluicegate.kernels import reference


def _caches(num_blocks, block_size, num_kv_heads, head_dim, dtype):
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim).to(dtype)
    return k_cache, torch.randn_like(k_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 64), (3, 80), (8, 128)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_store_kv_matches_reference(dtype, num_kv_heads, head_dim, block_size) -> None:
    generator = torch.Generator().manual_seed(block_size + head_dim)
    num_blocks, num_tokens = 4, 9
    k_cache, v_cache = _caches(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    # Keys are a view into a fused QKV-like buffer, as the model produces them.
    fused = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=generator).to(dtype)
    key, value = fused[:, num_kv_heads : 2 * num_kv_heads], fused[:, 2 * num_kv_heads :]
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[[2, 5]] = -1
    expected_k, expected_v = k_cache.clone(), v_cache.clone()

    kernels.store_kv(key, value, k_cache, v_cache, slots.to(torch.int32))
    reference.store_kv(key, value, expected_k, expected_v, slots)

    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


def test_store_kv_only_touches_given_slots() -> None:
    k_cache, v_cache = _caches(3, 16, 2, 64, torch.float16)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    key, value = torch.randn(2, 2, 64).half(), torch.randn(2, 2, 64).half()

    kernels.store_kv(key, value, k_cache, v_cache, torch.tensor([-1, 35]))

    changed = (k_cache != before_k).any(dim=(2, 3)).nonzero().tolist()
    assert changed == [[2, 3]]
    assert torch.equal(k_cache[2, 3], key[1]) and torch.equal(v_cache[2, 3], value[1])
    v_cache[2, 3] = before_v[2, 3]
    assert torch.equal(v_cache, before_v)


def test_store_kv_rejects_mismatched_shapes() -> None:
    k_cache, v_cache = _caches(2, 16, 2, 64, torch.float32)
    with pytest.raises(ValueError, match="heads/dim"):
        kernels.store_kv(
            torch.randn(1, 4, 64), torch.randn(1, 4, 64), k_cache, v_cache, torch.tensor([0])
        )

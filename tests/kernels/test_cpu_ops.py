"""The decoder layer's compiled CPU operations against the torch code they stand in for
(``sluicegate.engine.models.layers`` and ``sluicegate.kernels.reference.store_kv``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sluicegate.engine.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rotary
from sluicegate.kernels import cpu_ops, reference

pytestmark = pytest.mark.skipif(
    not cpu_ops.supports(torch.zeros(1)), reason="the CPU kernels need a C++ compiler"
)

TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}


def _norm(size: int, seed: int) -> RMSNorm:
    norm = RMSNorm(size, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(size, generator=torch.Generator().manual_seed(seed)) + 0.5)
    return norm


@pytest.mark.parametrize("rows", [1, 7, 22, 300])
def test_rms_norm(rows: int) -> None:
    norm = _norm(96, rows)
    x = torch.randn(rows, 96) * 3
    torch.testing.assert_close(
        cpu_ops.rms_norm(x, norm.weight, norm.eps), norm._normalize(x), **TOLERANCE
    )
    # Per head over a strided view (Qwen3's query/key norms), leading dimensions kept.
    heads = torch.randn(rows, 200)[:, :192].view(rows, 3, 64)
    head_norm = _norm(64, rows + 1)
    torch.testing.assert_close(
        cpu_ops.rms_norm(heads, head_norm.weight, head_norm.eps),
        head_norm._normalize(heads),
        **TOLERANCE,
    )


def test_add_rms_norm_updates_both_in_place() -> None:
    norm = _norm(64, 3)
    x, residual = torch.randn(9, 64), torch.randn(9, 64)
    expected_sum = residual + x
    expected = norm._normalize(expected_sum)
    out, summed = cpu_ops.add_rms_norm_(x, residual, norm.weight, norm.eps)
    assert out is x and summed is residual
    torch.testing.assert_close(summed, expected_sum, **TOLERANCE)
    torch.testing.assert_close(out, expected, **TOLERANCE)


def test_rms_norm_module_takes_the_same_path_either_way() -> None:
    norm = _norm(32, 4)
    x, residual = torch.randn(5, 32), torch.randn(5, 32)
    with torch.inference_mode():
        out, summed = norm(x.clone(), residual.clone())
    torch.testing.assert_close(summed, residual + x, **TOLERANCE)
    torch.testing.assert_close(out, norm._normalize(residual + x), **TOLERANCE)


@pytest.mark.parametrize("rows", [1, 22, 500])
def test_silu_and_mul(rows: int) -> None:
    x = torch.randn(rows, 2 * 88) * 4
    gate, up = x.split(88, dim=-1)
    torch.testing.assert_close(cpu_ops.silu_and_mul(x), F.silu(gate) * up, **TOLERANCE)
    mlp = GatedMLP(16, 88, bias=False, act="silu")
    with torch.inference_mode():
        hidden = torch.randn(rows, 16)
        gate_up = mlp.gate_up_proj(hidden)
        expected = mlp.down_proj(F.silu(gate_up[:, :88]) * gate_up[:, 88:])
        torch.testing.assert_close(mlp(hidden), expected, **TOLERANCE)


def _torch_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


@pytest.mark.parametrize("head_dim", [64, 128, 6])
def test_rotary_in_place_on_a_view_of_the_qkv_output(head_dim: int) -> None:
    rotary = RotaryEmbedding(head_dim, 10000.0, None)
    positions = torch.tensor([0, 1, 5, 17, 300], dtype=torch.int32)
    cos, sin = rotary.cos_sin(positions, torch.float32)
    qkv = torch.randn(5, 6 * head_dim)
    q = qkv[:, : 4 * head_dim].view(5, 4, head_dim)  # tokens 6 heads apart: a strided view
    k = qkv[:, 4 * head_dim : 5 * head_dim].view(5, 1, head_dim)
    v_before = qkv[:, 5 * head_dim :].clone()
    expected_q, expected_k = _torch_rotary(q, cos, sin), _torch_rotary(k, cos, sin)
    assert apply_rotary(q, cos, sin) is q and apply_rotary(k, cos, sin) is k
    torch.testing.assert_close(q, expected_q, **TOLERANCE)
    torch.testing.assert_close(k, expected_k, **TOLERANCE)
    assert torch.equal(qkv[:, 5 * head_dim :], v_before)  # the values are untouched


def test_store_kv_matches_the_reference_and_skips_padding() -> None:
    generator = torch.Generator().manual_seed(5)
    caches = [torch.zeros(6, 4, 2, 8) for _ in range(4)]
    kv = torch.randn(5, 3, 2, 8, generator=generator)  # key and value as strided views
    key, value = kv[:, 0], kv[:, 2]
    slots = torch.tensor([3, -1, 22, 0, 9], dtype=torch.int32)
    cpu_ops.store_kv(key, value, caches[0], caches[1], slots)
    reference.store_kv(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(RuntimeError, match="past the cache"):
        cpu_ops.store_kv(key, value, caches[0], caches[1], torch.tensor([0, 1, 2, 3, 24]))


def test_other_devices_and_dtypes_keep_the_torch_code() -> None:
    assert not cpu_ops.supports(torch.zeros(1, dtype=torch.bfloat16))
    norm = RMSNorm(8, 1e-6).to(torch.bfloat16)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    assert torch.equal(norm(x), norm._normalize(x))

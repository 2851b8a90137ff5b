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

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# A kernel and the torch code it stands in for compute in float32 and round to the dtype:
# their results may sit a rounding or two apart (float32's summation order decides which way
# a value on the edge rounds).
TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 1e-5, "rtol": 1.6e-2},
    torch.float16: {"atol": 1e-5, "rtol": 2e-3},
}
# Against the torch code run in a 16-bit dtype, which rounds after every operator where the
# kernel rounds once, and loses more where terms cancel (rotary's difference of products).
LOOSE = {
    torch.float32: TOLERANCE[torch.float32],
    torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
    torch.float16: {"atol": 4e-3, "rtol": 4e-3},
}


def _norm(size: int, seed: int, dtype: torch.dtype = torch.float32) -> RMSNorm:
    norm = RMSNorm(size, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(size, generator=torch.Generator().manual_seed(seed)) + 0.5)
    return norm.to(dtype)


def _randn(*shape: int, dtype: torch.dtype, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 7, 22, 300])
def test_rms_norm(cpu_isa: str, rows: int, dtype: torch.dtype) -> None:
    # RMSNorm's reference rounds to the dtype before the weight and after it; so does the
    # kernel, computing in float32 between.
    norm = _norm(96, rows, dtype)
    x = _randn(rows, 96, dtype=dtype, seed=rows, scale=3)
    out = cpu_ops.rms_norm(x, norm.weight, norm.eps)
    assert out.dtype == dtype
    torch.testing.assert_close(out, norm._normalize(x), **TOLERANCE[dtype])
    # Per head over a strided view (Qwen3's query/key norms), leading dimensions kept; 100
    # columns a head, so the 16-bit rows end past the last whole vector of eight.
    heads = _randn(rows, 310, dtype=dtype, seed=rows + 1)[:, :300].view(rows, 3, 100)
    head_norm = _norm(100, rows + 1, dtype)
    torch.testing.assert_close(
        cpu_ops.rms_norm(heads, head_norm.weight, head_norm.eps),
        head_norm._normalize(heads),
        **TOLERANCE[dtype],
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_rms_norm_updates_both_in_place(cpu_isa: str, dtype: torch.dtype) -> None:
    norm = _norm(68, 3, dtype)
    x, residual = _randn(9, 68, dtype=dtype, seed=1), _randn(9, 68, dtype=dtype, seed=2)
    expected_sum = residual + x
    expected = norm._normalize(expected_sum)
    out, summed = cpu_ops.add_rms_norm_(x, residual, norm.weight, norm.eps)
    assert out is x and summed is residual
    # The sum is one addition rounded once on both sides: the same bits.
    assert torch.equal(summed, expected_sum)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_module_takes_the_same_path_either_way(cpu_isa: str, dtype: torch.dtype) -> None:
    norm = _norm(32, 4, dtype)
    x, residual = _randn(5, 32, dtype=dtype, seed=1), _randn(5, 32, dtype=dtype, seed=2)
    with torch.inference_mode():
        out, summed = norm(x.clone(), residual.clone())
    torch.testing.assert_close(summed, residual + x, **TOLERANCE[dtype])
    torch.testing.assert_close(out, norm._normalize(residual + x), **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 22, 500])
def test_silu_and_mul(cpu_isa: str, rows: int, dtype: torch.dtype) -> None:
    x = _randn(rows, 2 * 88, dtype=dtype, seed=rows, scale=4)
    gate, up = x.split(88, dim=-1)
    out = cpu_ops.silu_and_mul(x)
    assert out.dtype == dtype
    # The maths in float32 on the same values, rounded once, as the kernel does it.
    exact = (F.silu(gate.float()) * up.float()).to(dtype)
    torch.testing.assert_close(out, exact, **TOLERANCE[dtype])
    torch.testing.assert_close(out, F.silu(gate) * up, **LOOSE[dtype])
    mlp = GatedMLP(16, 88, bias=False, act="silu").to(dtype)
    with torch.inference_mode():
        hidden = _randn(rows, 16, dtype=dtype, seed=rows + 1)
        gate_up = mlp.gate_up_proj(hidden)
        expected = mlp.down_proj(F.silu(gate_up[:, :88]) * gate_up[:, 88:])
        torch.testing.assert_close(mlp(hidden), expected, **LOOSE[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_past_exps_range(cpu_isa: str, dtype: torch.dtype) -> None:
    # Gates whose exp overflows or underflows float32 (silu -0 or the gate itself), infinity
    # and NaN, 16 of them (one whole vector) and the same again in a row's tail.
    edges = [-1e4, -200.0, -104.5, -89.0, -88.5, -87.0, -20.0, -0.0]
    edges += [0.0, 20.0, 87.0, 88.5, 104.5, float("inf"), 3.0, float("nan")]
    gate = torch.tensor(edges + edges[:5]).to(dtype)
    up = torch.linspace(0.5, 2.0, gate.numel()).to(dtype)
    out = cpu_ops.silu_and_mul(torch.cat([gate, up]).unsqueeze(0))[0]
    exact = (F.silu(gate.float()) * up.float()).to(dtype)
    torch.testing.assert_close(out, exact, equal_nan=True, **TOLERANCE[dtype])


def _torch_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 6])
def test_rotary_in_place_on_a_view_of_the_qkv_output(head_dim: int, dtype: torch.dtype) -> None:
    rotary = RotaryEmbedding(head_dim, 10000.0, None)
    positions = torch.tensor([0, 1, 5, 17, 300], dtype=torch.int32)
    cos, sin = rotary.cos_sin(positions, dtype)
    qkv = _randn(5, 6 * head_dim, dtype=dtype, seed=head_dim)
    q = qkv[:, : 4 * head_dim].view(5, 4, head_dim)  # tokens 6 heads apart: a strided view
    k = qkv[:, 4 * head_dim : 5 * head_dim].view(5, 1, head_dim)
    v_before = qkv[:, 5 * head_dim :].clone()
    exact_q, exact_k = (
        _torch_rotary(t.float(), cos.float(), sin.float()).to(dtype) for t in (q, k)
    )
    expected_q, expected_k = _torch_rotary(q, cos, sin), _torch_rotary(k, cos, sin)
    assert apply_rotary(q, cos, sin) is q and apply_rotary(k, cos, sin) is k
    torch.testing.assert_close(q, exact_q, **TOLERANCE[dtype])
    torch.testing.assert_close(k, exact_k, **TOLERANCE[dtype])
    torch.testing.assert_close(q, expected_q, **LOOSE[dtype])
    torch.testing.assert_close(k, expected_k, **LOOSE[dtype])
    assert torch.equal(qkv[:, 5 * head_dim :], v_before)  # the values are untouched


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_kv_matches_the_reference_and_skips_padding(dtype: torch.dtype) -> None:
    caches = [torch.zeros(6, 4, 2, 8, dtype=dtype) for _ in range(4)]
    kv = _randn(5, 3, 2, 8, dtype=dtype, seed=5)  # key and value as strided views
    key, value = kv[:, 0], kv[:, 2]
    slots = torch.tensor([3, -1, 22, 0, 9], dtype=torch.int32)
    cpu_ops.store_kv(key, value, caches[0], caches[1], slots)
    reference.store_kv(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(RuntimeError, match="past the cache"):
        cpu_ops.store_kv(key, value, caches[0], caches[1], torch.tensor([0, 1, 2, 3, 24]))


def test_store_kv_takes_the_caches_dtype_only() -> None:
    # A float32 key into a bfloat16 cache is a conversion, the reference's to make.
    caches = [torch.zeros(6, 4, 2, 8, dtype=torch.bfloat16) for _ in range(2)]
    key = torch.randn(2, 2, 8)
    with pytest.raises(RuntimeError, match="cache's dtype"):
        cpu_ops.store_kv(key, key, caches[0], caches[1], torch.tensor([0, 1]))


def test_other_devices_and_dtypes_keep_the_torch_code() -> None:
    assert all(cpu_ops.supports(torch.zeros(1, dtype=dtype)) for dtype in DTYPES)
    assert not cpu_ops.supports(torch.zeros(1, dtype=torch.float64))
    norm = RMSNorm(8, 1e-6).double()
    x = torch.randn(3, 8, dtype=torch.float64)
    assert torch.equal(norm(x), norm._normalize(x))
    # A float32 weight on bfloat16 rows promotes to float32 in the torch code: it keeps it.
    norm = RMSNorm(8, 1e-6)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    assert norm(x).dtype == torch.float32 and torch.equal(norm(x), norm._normalize(x))

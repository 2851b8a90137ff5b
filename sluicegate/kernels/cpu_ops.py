"""The decoder layer's small operations on the CPU (``csrc/layer_ops.cpp``), each one pass
over its rows where eager torch runs three to eight operators: RMSNorm (alone and fused with
the residual add before it), SiLU x mul, rotary embedding in place, and the KV-cache write.

Their references are the torch code they stand in for: ``sluicegate.engine.models.layers`` (RMSNorm,
``apply_rotary``, GatedMLP) and ``sluicegate.kernels.reference.store_kv``. ``supports(x)`` says whether
a tensor can take them: float32, bfloat16 or float16 on the CPU with the CPU kernels'
extension built (``sluicegate.kernels.cpu_build``); anything else keeps the torch code, so CUDA graphs
and compilation never see these. Every tensor of one call (weights, cos and sin, caches) has
the dtype of ``x``: 16-bit rows are widened to float32, computed, and rounded as they are
stored (RMSNorm also where its reference casts back before the weight).
"""

from __future__ import annotations

from types import ModuleType

import torch

from sluicegate.kernels.cpu_build import extension

__all__ = [
    "DTYPES",
    "add_rms_norm_",
    "allow_avx512",
    "rms_norm",
    "rotary_",
    "silu_and_mul",
    "store_kv",
    "supports",
]

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The element types the CPU kernels read and write (computing in float32)."""


def supports(x: torch.Tensor) -> bool:
    """One of ``DTYPES`` on the CPU, eager (a forward being compiled keeps the torch code),
    and the extension built."""
    return (
        x.device.type == "cpu"
        and x.dtype in DTYPES
        and not torch.compiler.is_compiling()
        and extension() is not None
    )


def _ops() -> ModuleType:
    kernels = extension()
    assert kernels is not None, "check sluicegate.kernels.cpu_ops.supports() first"
    return kernels


def allow_avx512(allow: bool) -> bool:
    """Let RMSNorm and SiLU x mul take their AVX-512 rows on 16-bit tensors where the CPU has
    AVX-512 (on by default; tests and benches turn it off to run the AVX2 ones); returns the
    previous setting."""
    return bool(_ops().layer_ops_allow_avx512(allow))


def _rows(x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _ops().rms_norm(_rows(x), weight, eps).view(x.shape)


def add_rms_norm_(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual += x`` and ``x = RMSNorm(residual)``, both in place (``x`` and
    ``residual`` must be 2-D and writable); returns (x, residual)."""
    _ops().add_rms_norm_(x, residual, weight, eps)
    return x, residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    rows = _rows(x)
    return _ops().silu_and_mul(rows).view(*x.shape[:-1], rows.shape[1] // 2)


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [tokens, heads, head_dim] in place by ``cos``/``sin`` [tokens, head_dim]."""
    _ops().rotary_(x, cos, sin)
    return x


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """``sluicegate.kernels.reference.store_kv`` (same signature and slot -1 rule)."""
    _ops().store_kv(key, value, k_cache, v_cache, slot_mapping)

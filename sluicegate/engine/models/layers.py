"""Building blocks shared by the native decoder models (RMSNorm, rotary embedding, MLP).

The torch code here is the definition; float32, bfloat16 and float16 tensors on the CPU take
the compiled equivalents in ``sluicegate.kernels.cpu_ops`` instead (one pass where torch runs
several operators), where every tensor of the call has one dtype.
"""

from __future__ import annotations

import math
from typing import Any, overload

import torch
import torch.nn.functional as F
from torch import nn

from sluicegate.engine.models.cpu.threads import on_one_thread
from sluicegate.engine.parallel.shard import TensorParallel, reduce_partial_sums
from sluicegate.kernels import cpu_ops


class RMSNorm(nn.Module):
    """Normalises in float32 and casts back before scaling, exactly as the HF Llama family.

    Given the residual stream too, it first adds ``x`` to it (the decoder layer's residual
    connection) and returns the normalised sum and the sum; on the CPU (the weight in x's
    dtype) both happen in place, in ``x`` and ``residual``.
    """

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    @overload
    def forward(self, x: torch.Tensor) -> torch.Tensor: ...
    @overload
    def forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        compiled = cpu_ops.supports(x) and self.weight.dtype == x.dtype
        if residual is None:
            if compiled:
                return cpu_ops.rms_norm(x, self.weight, self.eps)
            return self._normalize(x)
        if compiled and x.dim() == 2 and residual.dim() == 2 and residual.dtype == x.dtype:
            return cpu_ops.add_rms_norm_(x, residual, self.weight, self.eps)
        residual = residual + x
        return self._normalize(residual), residual

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding:
    """Neox-style rotary position embedding with optional linear or Llama-3 frequency scaling.

    Not an nn.Module: the inverse frequencies are derived from the config, never loaded, and
    cos/sin are computed per step for exactly the positions in the batch.
    """

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None) -> None:
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float()
        inv_freq = 1.0 / (theta ** (exponents / head_dim))
        self.attention_scaling = 1.0
        if scaling is not None:
            inv_freq = _scale_frequencies(inv_freq, scaling)
        self._inv_freq_cpu = inv_freq
        self._inv_freq: torch.Tensor | None = None

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        if self._inv_freq is None or self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq_cpu.to(positions.device)
        freqs = positions.float()[:, None] * self._inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        cos = (angles.cos() * self.attention_scaling).to(dtype)
        sin = (angles.sin() * self.attention_scaling).to(dtype)
        return cos, sin  # [tokens, head_dim] each


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` [tokens, heads, head_dim] rotated by ``cos``/``sin`` [tokens, head_dim] (on the
    CPU, all three of one dtype: in place)."""
    if cpu_ops.supports(x) and cos.dtype == sin.dtype == x.dtype:
        return cpu_ops.rotary_(x, cos, sin)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def _scale_frequencies(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
        high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
        old_context = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context / low_freq_factor
        high_freq_wavelen = old_context / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        in_band = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(in_band, blended, scaled)
    raise ValueError(f"unsupported rope scaling {rope_type!r}; supported: default, linear, llama3")


class GatedMLP(nn.Module):
    """SiLU-gated feed-forward with gate and up projections fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, act: str) -> None:
        super().__init__()
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}; only silu is implemented")
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        # Set where gate_up_proj was swapped for a kernel that returns silu(gate) * up itself
        # (sluicegate.engine.models.cpu.linears: the packed CPU product).
        self.gate_up_applies_activation = False
        self.activation_serial_rows = 0
        """Up to this many rows the CPU's SiLU x mul runs on one thread
        (``sluicegate.engine.models.cpu.threads``)."""
        self.tp: TensorParallel | None = None
        self.split_product: nn.Module | None = None
        """Set where both products were replaced by one module computing the whole MLP
        (``sluicegate.engine.models.cpu.split_mlp``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_partial_sums(self._partial(x), self.tp)

    def _partial(self, x: torch.Tensor) -> torch.Tensor:
        if self.split_product is not None:
            return self.split_product(x)
        gate_up = self.gate_up_proj(x)
        if self.gate_up_applies_activation:
            return self.down_proj(gate_up)
        if cpu_ops.supports(gate_up):
            if gate_up.numel() // gate_up.shape[-1] <= self.activation_serial_rows:
                return self.down_proj(on_one_thread(cpu_ops.silu_and_mul, gate_up))
            return self.down_proj(cpu_ops.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)

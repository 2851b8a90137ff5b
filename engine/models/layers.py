"""Building blocks shared by the native decoder models (RMSNorm, rotary embedding, MLP)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Normalises in float32 and casts back before scaling, exactly as the HF Llama family."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
        # [tokens, 1, head_dim]: broadcasts over heads.
        return cos[:, None, :], sin[:, None, :]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)

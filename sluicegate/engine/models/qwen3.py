"""Qwen3: the Llama layout plus an RMSNorm over each query and key head before RoPE."""

from __future__ import annotations

import torch

from sluicegate.engine.models.config import ModelConfig
from sluicegate.engine.models.layers import RMSNorm
from sluicegate.engine.models.llama import LlamaAttention, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)


class Qwen3ForCausalLM(LlamaForCausalLM):
    attention_class = Qwen3Attention

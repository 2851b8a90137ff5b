"""Llama-family decoder (Llama 2/3, Mistral, Qwen2) reading and writing the paged KV cache.

Parameter names follow the Hugging Face checkpoints, except that q/k/v and gate/up are fused
into ``qkv_proj`` and ``gate_up_proj`` (fewer, larger matmuls); ``load_weights`` maps the
checkpoint's separate tensors into their slices.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from sluicegate.engine.models.config import ModelConfig
from sluicegate.engine.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rotary
from sluicegate.engine.models.quant.linear import QuantizedProjection
from sluicegate.engine.parallel.shard import (
    TensorParallel,
    embed,
    gather_logits,
    reduce_partial_sums,
)
from sluicegate.engine.runner.attention import AttentionMetadata, PagedAttention

CosSin = tuple[torch.Tensor, torch.Tensor]


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5
        )
        self.tp: TensorParallel | None = None

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook for architectures that normalise queries and keys per head (Qwen3)."""
        return q, k

    def forward(self, x: torch.Tensor, cos_sin: CosSin, meta: AttentionMetadata) -> torch.Tensor:
        out = self.attend(x, cos_sin, meta)
        return reduce_partial_sums(self.o_proj(out), self.tp)

    def attend(self, x: torch.Tensor, cos_sin: CosSin, meta: AttentionMetadata) -> torch.Tensor:
        """The attention's output [tokens, heads x head_dim], before the output projection."""
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        q, k = self.normalize_qk(q, k)
        cos, sin = cos_sin
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        return self.attn(q, k, v, meta).reshape(tokens, self.q_size)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, attention: type[LlamaAttention]) -> None:
        super().__init__()
        self.self_attn = attention(config)
        self.mlp = GatedMLP(
            config.hidden_size, config.intermediate_size, config.mlp_bias, config.hidden_act
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.split_tail: nn.Module | None = None
        """Set where the output projection, the residual add with RMSNorm and the MLP were
        replaced by one module computing all three (``sluicegate.engine.models.cpu.split_mlp``):
        it takes the attention's output and the residual stream and returns as this does."""

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos_sin: CosSin,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's output before its residual add, and the residual stream: each layer
        adds the previous one's output inside its first RMSNorm (one pass on the CPU)."""
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        if self.split_tail is not None:
            return self.split_tail(self.self_attn.attend(x, cos_sin, meta), residual)
        x = self.self_attn(x, cos_sin, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, attention: type[LlamaAttention]) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, attention) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.tp: TensorParallel | None = None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = embed(self.embed_tokens.weight, input_ids, self.tp)
        cos_sin = self.rotary.cos_sin(positions, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos_sin, meta)
        if residual is None:  # a model without layers
            return self.norm(x)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    attention_class: ClassVar[type[LlamaAttention]] = LlamaAttention

    # checkpoint name -> (our fused parameter, slice index among its parts)
    _FUSED: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, self.attention_class)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.tp: TensorParallel | None = None

    def shard(self, tp: TensorParallel) -> None:
        """Make this (still unloaded, ``local_config``-built) model one rank of ``tp``: its
        vocabulary's run in the embedding and LM head, and the collectives in its forward;
        ``load_weights`` then takes this rank's slice of every checkpoint tensor."""
        vocab, hidden = len(tp.plan.vocab), self.config.hidden_size
        device, dtype = self.lm_head.weight.device, self.lm_head.weight.dtype
        self.model.embed_tokens = nn.Embedding(vocab, hidden, device=device, dtype=dtype)
        self.lm_head = nn.Linear(hidden, vocab, bias=False, device=device, dtype=dtype)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.tp = self.model.tp = tp
        for layer in self.model.layers:
            layer.self_attn.tp = layer.mlp.tp = tp

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return gather_logits(self.lm_head(hidden), self.tp)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in; raises if any parameter is left unset or unknown.
        A quantized projection takes its checkpoint tensors itself, whatever their names."""
        params = dict(self.named_parameters())
        quantized = {
            name: module
            for name, module in self.named_modules()
            if isinstance(module, QuantizedProjection)
        }
        loaded: set[tuple[str, int]] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            target, part = name, 0
            for original, (fused, index) in self._FUSED.items():
                if f".{original}." in name:
                    target, part = name.replace(f".{original}.", f".{fused}."), index
                    break
            module, _, leaf = target.rpartition(".")
            if module in quantized:
                quantized[module].load_checkpoint_tensor(part, leaf, tensor)
                continue
            if target not in params:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no place in {type(self).__name__}"
                )
            if self.tp is not None:
                tensor = self.tp.plan.shard(target, part, tensor)
            sizes = self._parts(target)
            destination = params[target]
            if len(sizes) > 1:
                destination = destination.narrow(0, sum(sizes[:part]), sizes[part])
            if destination.shape != tensor.shape:
                raise ValueError(
                    f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(destination.shape)}"
                )
            destination.copy_(tensor)
            loaded.add((target, part))
        missing = [
            name
            for name in params
            if any((name, part) not in loaded for part in range(len(self._parts(name))))
            and not (name == "lm_head.weight" and self.config.tie_word_embeddings)
            and name.rpartition(".parts.")[0] not in quantized
            and name.rpartition(".")[0] not in quantized
        ]
        missing += [
            f"{name} ({what})" for name, module in quantized.items() for what in module.unloaded()
        ]
        if missing:
            raise ValueError(f"checkpoint lacks tensors for: {missing[:8]}")

    def projection_parts(self, module_name: str) -> list[tuple[str, int]]:
        """The checkpoint linears behind one of our projections (``...qkv_proj``: its q, k
        and v), each with its output rows, in order."""
        parent, _, leaf = module_name.rpartition(".")
        originals = sorted(
            (index, original) for original, (fused, index) in self._FUSED.items() if fused == leaf
        )
        if not originals:
            linear = self.get_submodule(module_name)
            return [(module_name, linear.out_features)]
        sizes = self._parts(f"{module_name}.weight")
        return [(f"{parent}.{original}", sizes[index]) for index, original in originals]

    def _parts(self, param_name: str) -> list[int]:
        """Row sizes of the checkpoint tensors fused into ``param_name`` ([rows] if not fused)."""
        c = self.config
        module = param_name.split(".")[-2]
        if module == "qkv_proj":
            kv = c.num_key_value_heads * c.head_dim
            return [c.num_attention_heads * c.head_dim, kv, kv]
        if module == "gate_up_proj":
            return [c.intermediate_size, c.intermediate_size]
        return [0]

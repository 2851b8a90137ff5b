"""A decoder's shape (layers, heads, KV heads, head dim, sliding windows, sizes) read from
any Hugging Face ``config.json``, and its parameter count. Plain Python: no torch, so the
capacity planner can use it without the engine's dependencies."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_ARCHITECTURE_TO_TYPE = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


def _first(config: dict[str, Any], *names: str) -> Any:
    """The first of ``names`` the config sets: transformers' classes spell the same field
    differently (``num_hidden_layers``, GPT-2's ``n_layer``, Falcon's ``num_kv_heads``...)."""
    for name in names:
        if config.get(name) is not None:
            return config[name]
    return None


def _layer_windows(config: dict[str, Any], num_layers: int) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention), as transformers assigns them:
    per ``layer_types`` when the config lists them, else one window for every layer."""
    window = config.get("sliding_window")
    if not window or config.get("use_sliding_window") is False:
        return (None,) * num_layers
    layer_types = config.get("layer_types")
    if layer_types:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    return (int(window),) * num_layers


@dataclass(frozen=True)
class ModelShape:
    """The config fields that decide parameter count and KV size."""

    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    # Per layer; the block pool still keeps every layer's whole context (windowed layers
    # mask what they do not see), so windows do not shrink KV per token.
    layer_windows: tuple[int | None, ...] = ()

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        """Any decoder config transformers writes; multimodal ones by their ``text_config``."""
        model_type = config.get("model_type") or next(
            (
                _ARCHITECTURE_TO_TYPE[a]
                for a in config.get("architectures", [])
                if a in _ARCHITECTURE_TO_TYPE
            ),
            "",
        )
        text = {**config, **(config.get("text_config") or {})}
        hidden = _first(text, "hidden_size", "n_embd", "d_model")
        heads = _first(text, "num_attention_heads", "n_head", "num_heads")
        layers = _first(text, "num_hidden_layers", "n_layer", "num_layers")
        if hidden is None or heads is None or layers is None:
            raise ValueError(
                "config lacks the attention shape (hidden size, attention heads, layers)"
            )
        heads, layers = int(heads), int(layers)
        kv_heads = _first(text, "num_key_value_heads", "num_kv_heads", "n_head_kv")
        if kv_heads is None and text.get("multi_query"):
            kv_heads = 1
        intermediate = _first(text, "intermediate_size", "n_inner", "ffn_dim")
        return cls(
            model_type=model_type,
            num_layers=layers,
            hidden_size=int(hidden),
            num_heads=heads,
            num_kv_heads=int(kv_heads or heads),
            head_dim=int(text.get("head_dim") or int(hidden) // heads),
            intermediate_size=int(intermediate or 4 * int(hidden)),
            vocab_size=int(text.get("vocab_size") or 0),
            tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama-family configs may opt in.
            attention_bias=bool(text.get("attention_bias", False)),
            mlp_bias=bool(text.get("mlp_bias", False)),
            layer_windows=_layer_windows(text, layers),
        )

    @property
    def has_parameter_formula(self) -> bool:
        return self.model_type in SUPPORTED_MODEL_TYPES

    def parameter_count(self) -> int:
        """Exact for the native families (Llama, Mistral, Qwen2, Qwen3) only."""
        if not self.has_parameter_formula:
            raise ValueError(
                f"no parameter formula for model type {self.model_type!r} (one exists for "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}); pass its model folder, whose "
                "*.safetensors headers give the exact count"
            )
        hidden, head_dim = self.hidden_size, self.head_dim
        q_size = self.num_heads * head_dim
        kv_size = self.num_kv_heads * head_dim
        attention = hidden * q_size + 2 * hidden * kv_size + q_size * hidden
        if self.model_type == "qwen2":
            attention += q_size + 2 * kv_size
        elif self.attention_bias:
            attention += q_size + 2 * kv_size + hidden
        if self.model_type == "qwen3":
            attention += 2 * head_dim  # RMSNorm over each query and key head
        mlp = 3 * hidden * self.intermediate_size
        if self.mlp_bias:
            mlp += 2 * self.intermediate_size + hidden
        layer = attention + mlp + 2 * hidden  # input and post-attention RMSNorm
        embeddings = self.vocab_size * hidden
        lm_head = 0 if self.tie_word_embeddings else self.vocab_size * hidden
        return embeddings + self.num_layers * layer + hidden + lm_head

    def kv_bytes_per_token(self, kv_dtype_bytes: int, kv_heads: int | None = None) -> int:
        """Bytes of K and V a token takes over all layers (``kv_heads``: a rank's share)."""
        heads = self.num_kv_heads if kv_heads is None else kv_heads
        return 2 * self.num_layers * heads * self.head_dim * kv_dtype_bytes

    def linear_weights(self) -> tuple[int, int]:
        """The decoder layers' projection weights (what a quantized checkpoint quantizes)
        and their output rows (one scale each in a per-channel scheme), all layers."""
        hidden = self.hidden_size
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        inter = self.intermediate_size
        weights = hidden * (q_size + 2 * kv_size) + q_size * hidden + 3 * hidden * inter
        rows = q_size + 2 * kv_size + hidden + 2 * inter + hidden
        return self.num_layers * weights, self.num_layers * rows

    def vocab_weights(self) -> int:
        """The embedding and (untied) LM head matrices."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)


def checkpoint_param_count(path: str | Path) -> int | None:
    """Parameters stored in a model folder's ``*.safetensors``, read from the files' JSON
    headers alone (8-byte little-endian length, then the header); None without weights."""
    folder = Path(path)
    folder = folder if folder.is_dir() else folder.parent
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return None
    total = 0
    for file in files:
        with file.open("rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(length))
        for name, entry in header.items():
            if name != "__metadata__":
                count = 1
                for size in entry["shape"]:
                    count *= size
                total += count
    return total

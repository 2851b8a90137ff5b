"""The architecture facts the native models need, read from a Hugging Face ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name.removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; use float32, bfloat16 or float16") from None


@dataclass
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    hidden_act: str
    dtype: torch.dtype
    eos_token_ids: list[int] = field(default_factory=list)
    # Attention window (Mistral v0.1); the models attend to the full context, so the engine
    # caps the context length at the window, where both agree.
    sliding_window: int | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        architectures = raw.get("architectures") or []
        heads = raw["num_attention_heads"]
        rope_theta, rope_scaling = _rope(raw)
        model_type = raw.get("model_type", "")
        attention_bias = bool(raw.get("attention_bias", False))
        eos = raw.get("eos_token_id")
        return cls(
            architecture=architectures[0] if architectures else "",
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and no flag for them.
            qkv_bias=attention_bias or model_type == "qwen2",
            o_bias=attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            hidden_act=raw.get("hidden_act", "silu"),
            dtype=parse_dtype(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            eos_token_ids=[eos] if isinstance(eos, int) else list(eos or []),
            sliding_window=(
                raw.get("sliding_window") if raw.get("use_sliding_window", True) else None
            ),
        )

    @classmethod
    def from_folder(cls, path: str | Path) -> ModelConfig:
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(
                f"{config_file} not found: expected a Hugging Face model folder"
            )
        return cls.from_dict(json.loads(config_file.read_text()))


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Rope settings from either layout: transformers 5 ``rope_parameters`` or the older
    ``rope_theta`` + ``rope_scaling``. Returns (theta, scaling or None for plain RoPE)."""
    params = raw.get("rope_parameters")
    if params is not None:
        params = dict(params)
        theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    else:
        theta = float(raw.get("rope_theta", 10000.0))
        params = dict(raw.get("rope_scaling") or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    params["rope_type"] = rope_type
    return theta, params

"""peft adapters with non-zero B matrices (``init_lora_weights=False``) on a base model
folder, and transformers + peft's greedy tokens for them: what the engine is held to."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

from tests.engine.models.greedy import transformers_greedy

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base: Path,
    folder: Path,
    *,
    seed: int,
    rank: int = 8,
    alpha: float = 16,
    targets: list[str] | None = None,
    rslora: bool = False,
    weight_scale: float = 1.0,
) -> Path:
    """A LoRA adapter of ``base`` saved by peft to ``folder``; A and B drawn at random
    (``weight_scale`` scales them, so the adapter visibly changes the greedy tokens)."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=targets or ALL_PROJECTIONS,
        init_lora_weights=False,
        use_rslora=rslora,
    )
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.mul_(weight_scale)
    peft_model.save_pretrained(folder)
    return folder


def peft_greedy(
    base: Path,
    adapter: Path | None,
    prompts: list[list[int]],
    max_new_tokens: int,
    dtype: torch.dtype = torch.float32,
) -> list[list[int]]:
    """transformers (+ peft's adapter, unless None) greedy tokens for each prompt."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    return transformers_greedy(model, prompts, max_new_tokens)

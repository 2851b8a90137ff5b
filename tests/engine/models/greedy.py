"""transformers' own greedy generation, the reference the engine's greedy tokens are held to."""

from __future__ import annotations

import torch


def transformers_greedy(
    model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
    """Each prompt's ``max_new_tokens`` greedy tokens, past any end-of-sequence token."""
    model.generation_config.eos_token_id = None
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                do_sample=False,
            )  # fmt: skip
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs

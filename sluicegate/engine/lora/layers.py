"""``LoraLinear``: a native model's projection (whatever runs it: ``nn.Linear``, the packed
CPU product, oneDNN, a quantized linear) plus the LoRA deltas of the step's adapters, held
in ``max_loras`` device slots.

Wrapped right after the weights load, before the CPU linears are chosen: the swap then
replaces the wrapped ``nn.Linear`` inside, and a gated MLP's ``gate_up_proj`` is no longer a
bare ``nn.Linear``, so it is not fused with its SiLU (the adapter's delta must be added to
gate and up before the activation).
"""

from __future__ import annotations

import torch
from torch import nn

from sluicegate.engine.lora.adapter import Projection
from sluicegate.engine.lora.ops import LoraPlan, add_lora_
from sluicegate.engine.models.llama import LlamaForCausalLM

# The projections LoRA is served on, by our module's last name.
TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class LoraStep:
    """The plan of the step being run, shared by every ``LoraLinear`` of a model (None: no
    row of the step has an adapter, and each linear adds nothing)."""

    def __init__(self) -> None:
        self.plan: LoraPlan | None = None


class LoraLinear(nn.Module):
    def __init__(
        self,
        base: nn.Module,
        projection: Projection,
        step: LoraStep,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.base = base
        self.in_features = projection.in_features
        self.out_features = projection.out_features
        self.step = step
        slices = len(projection.parts) * max_rank
        # Buffers, not parameters: the weights' loader and the CPU linears' swap skip them.
        self.register_buffer(
            "lora_a",
            torch.zeros(max_loras, slices, self.in_features, dtype=dtype, device=device),
            persistent=False,
        )
        self.register_buffer(
            "lora_b",
            torch.zeros(max_loras, self.out_features, slices, dtype=dtype, device=device),
            persistent=False,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        plan = self.step.plan
        if plan is None:
            return y
        return add_lora_(y, x, self.lora_a, self.lora_b, plan)

    @torch.no_grad()
    def set_slot(self, slot: int, weights: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Put an adapter's (A, B) for this projection in ``slot`` (None: it leaves this
        projection alone, zeros)."""
        if weights is None:
            self.lora_a[slot].zero_()
            self.lora_b[slot].zero_()
            return
        self.lora_a[slot].copy_(weights[0], non_blocking=True)
        self.lora_b[slot].copy_(weights[1], non_blocking=True)


def lora_projections(model: LlamaForCausalLM) -> dict[str, Projection]:
    """Every projection of ``model`` LoRA can target, by module name, with its checkpoint parts."""
    config = model.config
    q_size = config.num_attention_heads * config.head_dim
    inputs = {
        "qkv_proj": config.hidden_size,
        "o_proj": q_size,
        "gate_up_proj": config.hidden_size,
        "down_proj": config.intermediate_size,
    }
    return {
        name: Projection(inputs[name.rpartition(".")[2]], tuple(model.projection_parts(name)))
        for name, _ in model.named_modules()
        if name.rpartition(".")[2] in TARGETS
    }


def install_lora(
    model: LlamaForCausalLM, max_loras: int, max_rank: int
) -> tuple[LoraStep, dict[str, LoraLinear], dict[str, Projection]]:
    """Wrap every target projection of a loaded native model in place; returns the shared
    step state, the wrappers and their shapes, by module name."""
    projections = lora_projections(model)
    step = LoraStep()
    device = model.lm_head.weight.device
    wrapped: dict[str, LoraLinear] = {}
    for name, projection in projections.items():
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent)
        wrapper = LoraLinear(
            getattr(owner, leaf), projection, step, max_loras, max_rank, model.config.dtype, device
        )
        setattr(owner, leaf, wrapper)
        wrapped[name] = wrapper
    return step, wrapped, projections

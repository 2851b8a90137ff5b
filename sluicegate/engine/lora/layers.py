"""``LoraLinear``: a native model's projection (whatever runs it: ``nn.Linear``, the packed
CPU product, oneDNN, a quantized linear) plus the LoRA deltas of the step's adapters, held
in ``max_loras`` device slots.

Wrapped right after the weights load, before the CPU linears are chosen: the swap then
replaces the wrapped ``nn.Linear`` inside. A gated MLP's ``gate_up_proj`` on the packed CPU
product keeps its SiLU fused for steps without adapters (``fuse_gated_mlps``): its panels are
packed gate/up interleaved, and a step with adapters runs the same panels unfused (gate and
up side by side), adds the deltas to both, then applies the activation itself.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from sluicegate.engine.lora.adapter import Projection
from sluicegate.engine.lora.ops import LoraPlan, add_lora_
from sluicegate.engine.models.cpu.packed_linear import PackedLinear
from sluicegate.engine.models.layers import GatedMLP
from sluicegate.engine.models.llama import LlamaForCausalLM
from sluicegate.kernels import cpu_ops

# Output columns per panel of the packed CPU product (csrc/linear/packed_linear.cpp's kCols).
_PANEL = 16

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
        self.slices: list[tuple[int, int]] = []
        for _, rows in projection.parts:
            first = self.slices[-1][0] + self.slices[-1][1] if self.slices else 0
            self.slices.append((first, rows))
        slices = len(projection.parts) * max_rank
        # Buffers, not parameters: the weights' loader and the CPU linears' swap skip them.
        self.register_buffer(
            "lora_a",
            torch.zeros(max_loras, slices, self.in_features, dtype=dtype, device=device),
            persistent=False,
        )
        self.register_buffer(
            "lora_b",
            torch.zeros(max_loras, self.out_features, max_rank, dtype=dtype, device=device),
            persistent=False,
        )
        # Set by fuse_gated: the gate_up product unfused, its columns in panels of gate and
        # up in turn; then base(x) returns silu(gate) * up, and so does this module.
        self._unfused: object | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        plan = self.step.plan
        if self._unfused is not None and plan is not None:
            return self._gated_with_lora(x, plan)
        y = self.base(x)
        if plan is None:
            return y
        return add_lora_(y, x, self.lora_a, self.lora_b, plan, self.slices)

    def _gated_with_lora(self, x: torch.Tensor, plan: LoraPlan) -> torch.Tensor:
        from sluicegate.kernels import cpu_linear

        interleaved = cpu_linear.linear(x, self._unfused)  # type: ignore[arg-type]
        tokens, width = interleaved.shape
        y = interleaved.view(tokens, width // (2 * _PANEL), 2, _PANEL).transpose(1, 2)
        y = add_lora_(y.reshape(tokens, width), x, self.lora_a, self.lora_b, plan, self.slices)
        if cpu_ops.supports(y):
            return cpu_ops.silu_and_mul(y)
        gate, up = y.split(width // 2, dim=-1)
        return F.silu(gate) * up

    def fuse_gated(self) -> bool:
        """Repack a gate_up ``PackedLinear`` base gate/up interleaved, its SiLU fused (as the
        swap does without LoRA); whether it could (no bias, gate rows a whole number of
        panels)."""
        base = self.base
        if not isinstance(base, PackedLinear) or base.packed.gated or base.packed.bias is not None:
            return False
        plain = base.packed
        half_panels, remainder = divmod(plain.rows // 2, _PANEL)
        if remainder:
            return False
        order = torch.arange(2 * half_panels).view(2, half_panels).t().reshape(-1)
        unfused = copy.copy(plain)
        unfused.panels = plain.panels.index_select(0, order)
        fused = copy.copy(unfused)
        fused.gated, fused.out_features = True, plain.rows // 2
        base.packed, base.out_features = fused, fused.out_features
        self._unfused = unfused
        return True

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


def fuse_gated_mlps(model: nn.Module) -> int:
    """After the CPU linears' swap: every gated MLP whose LoRA-wrapped gate_up runs on the
    packed product gets its SiLU fused again; returns how many."""
    fused = 0
    for mlp in model.modules():
        if isinstance(mlp, GatedMLP) and isinstance(mlp.gate_up_proj, LoraLinear):
            if mlp.gate_up_proj.fuse_gated():
                mlp.gate_up_applies_activation = True
                fused += 1
    return fused


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

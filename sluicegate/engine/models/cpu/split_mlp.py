"""A 16-bit gated MLP on the CPU as two column halves on two threads in one parallel region
(``csrc/linear/split_mlp.cpp``), instead of oneDNN's gate/up product, SiLU x mul and down product
each choosing its threads.

A decode step's products stream their weights from memory at about one core's bandwidth per
thread, and where idle OpenMP threads sleep, every parallel region first wakes the other
thread: the unsplit MLP either pays that two or three times a layer or runs on one core's
bandwidth. Split by output columns, each thread runs its half of gate/up, SiLU x mul and its
half of down, with one wake-up. Past ``COLUMN_SPLIT_ROWS`` (a prefill chunk) each thread runs
the whole MLP for half of the rows instead. The model keeps one copy of the weights, split.

``python bench/cpu_mlp.py`` (SmolLM2's MLP in bfloat16, 30 layers of weights streamed from
memory, 2-vCPU Xeon VM with AMX, ``OMP_WAIT_POLICY=PASSIVE``), split vs unsplit a layer: 511
vs 700 µs at one row, 786 vs 1,052 at 64 (1.34-1.37x up to 64 rows), 1.12-1.2x at 256-1,024
rows (either split), and 7.95 vs 7.32 ms at 2,048 rows: a full prefill chunk's MLP is 8-10 %
slower, its cost.

Where a decoder layer allows it, the region takes the whole layer after its attention
(``SplitLayerTail``): the output projection, which unsplit ran on one thread (too short for a
wake-up of its own), by column halves, then the residual add and RMSNorm by row halves, then
the MLP. ``bench/cpu_mlp.py`` on a 2-vCPU AVX-512 EPYC VM: 1.13-1.21x the MLP-only split's
layer at 1-256 rows, 0.97x at 2,048 (two half-width output products), its cost.

Every output value is still one oneDNN product over all of its inputs; only oneDNN's own
blocking of a half-width product may sum in another order (results within a bfloat16
rounding of the unsplit MLP's). With ``pairs`` (``sluicegate.engine.models.cpu.linears``'
``pairs`` kind) the halves are packed for the CPU's bfloat16 dot products instead
(``sluicegate.kernels.cpu_pair_linear``) and the same region runs those.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from sluicegate.engine.models.cpu.onednn import pack_weight, packs
from sluicegate.engine.models.layers import GatedMLP, RMSNorm
from sluicegate.engine.models.llama import DecoderLayer
from sluicegate.kernels import cpu_pair_linear
from sluicegate.kernels.cpu_build import extension

COLUMN_SPLIT_ROWS = 256
"""Up to this many rows the halves run on two threads at once (the decode steps of up to
``max_num_seqs``'s default)."""


class SplitMLP(nn.Module):
    """silu(x W_gate^T) * (x W_up^T) W_down^T from a gated MLP's two linears, their weights
    packed for oneDNN (or by ``pack``) as two halves each."""

    def __init__(
        self,
        gate_up: nn.Linear,
        down: nn.Linear,
        pack: Callable[[torch.Tensor], torch.Tensor] = pack_weight,
    ) -> None:
        super().__init__()
        self.intermediate_size = down.in_features
        self.out_features = down.out_features
        half, out_half = self.intermediate_size // 2, self.out_features // 2
        gate, up = gate_up.weight.detach().split(self.intermediate_size)
        self.gate_up_halves = [
            pack(torch.cat([gate[t * half : (t + 1) * half], up[t * half : (t + 1) * half]]))
            for t in range(2)
        ]
        weight = down.weight.detach()
        self.down_halves = [pack(weight[t * out_half : (t + 1) * out_half]) for t in range(2)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = extension()
        assert kernels is not None
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        out = kernels.split_mlp(
            rows,
            self.gate_up_halves,
            self.down_halves,
            self.intermediate_size,
            rows.shape[0] <= COLUMN_SPLIT_ROWS,
        )
        return out.view(*x.shape[:-1], self.out_features)


def splittable(mlp: nn.Module, pairs: bool = False) -> bool:
    """A gated MLP, on a CPU with more than one thread, whose two products are plain bias-free
    linears of a 16-bit dtype oneDNN packs here, of even widths (not one wrapped for LoRA,
    fused with its activation, or quantized); ``pairs``: bfloat16 ones whose halves the
    bfloat16 dot products take whole (widths that are multiples of 32)."""
    if (
        not isinstance(mlp, GatedMLP)
        or mlp.gate_up_applies_activation
        or mlp.tp is not None
        or mlp.split_product is not None
    ):
        return False
    gate_up, down = mlp.gate_up_proj, mlp.down_proj
    if type(gate_up) is not nn.Linear or type(down) is not nn.Linear:
        return False
    dtype = gate_up.weight.dtype
    return (
        gate_up.bias is None
        and down.bias is None
        and gate_up.weight.device.type == "cpu"
        and dtype in (torch.bfloat16, torch.float16)
        and down.weight.dtype == dtype
        and down.in_features % 2 == 0
        and down.out_features % 2 == 0
        and torch.get_num_threads() > 1
        and packs(dtype)
        and extension() is not None
        and (not pairs or _pairs_take(dtype, down.in_features, down.out_features))
    )


def _pairs_take(dtype: torch.dtype, *widths: int) -> bool:
    # Each half of each width in whole 16-column panels: the two-thread region's product
    # reads a half's width off its panels.
    return (
        dtype == torch.bfloat16
        and all(width % 32 == 0 for width in widths)
        and cpu_pair_linear.available()
    )


class SplitLayerTail(nn.Module):
    """A decoder layer after its attention (``csrc/linear/split_mlp.cpp``, ``split_layer_tail``): the
    output projection by column halves, the residual add and RMSNorm by row halves, then the
    gated MLP as ``SplitMLP``, on two threads in one parallel region (one wake-up where the
    unsplit layer pays one for the MLP alone and runs the output projection on one thread).
    Takes the attention's output and the residual stream; returns the MLP's output and the
    residual stream (updated in place), as ``DecoderLayer`` does."""

    def __init__(
        self,
        o_proj: nn.Linear,
        norm: RMSNorm,
        mlp: GatedMLP,
        pack: Callable[[torch.Tensor], torch.Tensor] = pack_weight,
    ) -> None:
        super().__init__()
        half = o_proj.out_features // 2
        weight = o_proj.weight.detach()
        self.o_halves = [pack(weight[:half]), pack(weight[half:])]
        self.norm_weight = norm.weight.detach()
        self.eps = norm.eps
        self.mlp = SplitMLP(mlp.gate_up_proj, mlp.down_proj, pack)

    def forward(
        self, attn: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        kernels = extension()
        assert kernels is not None
        rows = attn.reshape(-1, attn.shape[-1]).contiguous()
        out = kernels.split_layer_tail(
            rows,
            residual,
            self.o_halves,
            self.norm_weight,
            self.eps,
            self.mlp.gate_up_halves,
            self.mlp.down_halves,
            self.mlp.intermediate_size,
            rows.shape[0] <= COLUMN_SPLIT_ROWS,
        )
        return out, residual


def splittable_tail(layer: DecoderLayer, pairs: bool = False) -> bool:
    """A decoder layer whose MLP is ``splittable`` and whose output projection is a plain
    bias-free linear of the MLP's dtype and even width, with an RMSNorm of that dtype between
    them (not one wrapped for LoRA, quantized or sharded)."""
    o_proj, norm, mlp = layer.self_attn.o_proj, layer.post_attention_layernorm, layer.mlp
    if (
        not splittable(mlp, pairs)
        or type(o_proj) is not nn.Linear
        or layer.self_attn.tp is not None
    ):
        return False
    assert isinstance(mlp, GatedMLP)
    dtype = mlp.gate_up_proj.weight.dtype
    return (
        o_proj.bias is None
        and o_proj.weight.dtype == dtype
        and o_proj.out_features % 2 == 0
        and type(norm) is RMSNorm
        and norm.weight.dtype == dtype
    )


def split_gated_mlps(model: nn.Module, pairs: bool = False) -> int:
    """Give each decoder layer of ``model`` that can take one a ``SplitLayerTail`` in place of
    its output projection and MLP linears, and each other splittable gated MLP a
    ``SplitMLP`` in place of its two (``pairs``: their weights packed for the bfloat16 dot
    products); returns how many linears were replaced."""
    replaced = 0
    pack = cpu_pair_linear.pack if pairs else pack_weight
    for layer in model.modules():
        if isinstance(layer, DecoderLayer) and splittable_tail(layer, pairs):
            layer.split_tail = SplitLayerTail(
                layer.self_attn.o_proj, layer.post_attention_layernorm, layer.mlp, pack
            )
            # The MLP, called alone, still computes itself (the same halves).
            layer.mlp.split_product = layer.split_tail.mlp
            del layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj
            replaced += 3
    for mlp in model.modules():
        if splittable(mlp, pairs):
            assert isinstance(mlp, GatedMLP)
            mlp.split_product = SplitMLP(mlp.gate_up_proj, mlp.down_proj, pack)
            del mlp.gate_up_proj, mlp.down_proj
            replaced += 2
    return replaced

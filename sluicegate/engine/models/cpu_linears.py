"""Which kernel runs a CPU float32 model's linears: ``packed`` (the compiled packed-weight
product, ``sluicegate.kernels.cpu_linear``), ``onednn`` (``sluicegate.engine.models.onednn``) or ``torch`` (aten's
default GEMM, ``nn.Linear`` as loaded). ``auto`` takes the faster of packed and oneDNN on
this machine, raced at start-up (``sluicegate.engine.models.cpu_linear_race``); either is 1.3-1.9x
faster than aten (``bench/cpu_linear.py``). The maths is the same float32 product; only the
summation order differs, as between any two GEMM libraries.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from sluicegate.engine.models.cpu_linear_race import describe, packed_wins, race
from sluicegate.engine.models.layers import GatedMLP
from sluicegate.engine.models.onednn import OneDNNLinear
from sluicegate.engine.models.packed_linear import PackedLinear

CPU_LINEARS = ("auto", "packed", "onednn", "torch")

logger = logging.getLogger(__name__)


def _float32_on_cpu(model: nn.Module) -> bool:
    params = list(model.parameters())
    return bool(params) and all(p.device.type == "cpu" and p.dtype == torch.float32 for p in params)


def resolve_cpu_linears(requested: str, model: nn.Module) -> str:
    """The kernel ``requested`` means for ``model``: ``torch`` unless the model is float32 on
    the CPU; ``auto`` the fastest this machine has."""
    if requested not in CPU_LINEARS:
        raise ValueError(f"unknown cpu_linears {requested!r}; choose one of {CPU_LINEARS}")
    if requested == "torch" or not _float32_on_cpu(model):
        return "torch"
    from sluicegate.kernels import cpu_linear

    packed, onednn = cpu_linear.available(), torch.backends.mkldnn.is_available()
    if requested == "packed" and not packed:
        raise ValueError("cpu_linears='packed' needs the CPU kernels built with AVX2 and FMA")
    if requested == "onednn" and not onednn:
        raise ValueError("cpu_linears='onednn' needs a torch built with oneDNN")
    if requested != "auto":
        return requested
    if packed and onednn:
        ratios = race(model)
        logger.info(
            "CPU linears raced, the packed product's time over oneDNN's: %s", describe(ratios)
        )
        return "packed" if packed_wins(ratios) else "onednn"
    return "packed" if packed else "onednn" if onednn else "torch"


def swap_cpu_linears(model: nn.Module, kind: str) -> int:
    """Replace every ``nn.Linear`` of a loaded model in place with ``kind``'s module (from
    ``resolve_cpu_linears``); returns how many."""
    replacement = {"packed": PackedLinear, "onednn": OneDNNLinear}.get(kind)
    if replacement is None:
        return 0
    swapped = 0
    if kind == "packed":
        # A gated MLP's SiLU x mul goes into its gate_up product (the wide product never
        # goes to memory, and one operator fewer per layer).
        for mlp in model.modules():
            if isinstance(mlp, GatedMLP) and type(mlp.gate_up_proj) is nn.Linear:
                mlp.gate_up_proj = PackedLinear(mlp.gate_up_proj, gated=True)
                mlp.gate_up_applies_activation = True
                swapped += 1
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, replacement(child))
                swapped += 1
    return swapped

"""Which CPU linear kernel is faster on this machine, measured at start-up on the model's own
weights: the packed product (``sluicegate.kernels.cpu_linear``) or oneDNN.

Neither is sure to win everywhere. On AMD EPYC machines without AVX-512 the packed kernel ran a
decode step's linears about 1.5x faster than oneDNN; on one with full 512-bit units, while
the packed kernel had only AVX2 tiles, oneDNN ran 8 rows and more 1.4-1.9x faster and a
prefill chunk nearly 2x; with its AVX-512 tiles the packed kernel is 1.0-1.4x oneDNN's speed
there (``bench/cpu_linear.py``). A CPU neither was measured on may differ again, so ``auto``
races the two on a slice of the model's widest layer linear at a few rows and a prefill
chunk's worth, and takes the winner for the whole model (one packed copy of the weights,
not two).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from sluicegate.engine.models.cpu.onednn import OneDNNLinear
from sluicegate.engine.models.cpu.packed_linear import PackedLinear

RACE_ROWS = (4, 32, 512)
"""Rows per product raced: a small decode batch, a larger one, a prefill chunk."""
_MAX_OUT_FEATURES = 4096
"""The raced slice's output width: a big model's layer is raced on part of its weight."""
_REPEATS = 3


def race(
    model: nn.Module,
    opponent: Callable[[nn.Linear], nn.Module] = OneDNNLinear,
    contender: Callable[[nn.Linear], nn.Module] = PackedLinear,
) -> dict[int, float]:
    """Per row count in ``RACE_ROWS``, ``contender``'s time (the packed kernel's by default)
    over ``opponent``'s (best of a few alternating runs each) on a slice of the model's widest
    linear outside the LM head, in the model's dtype. Each builds a module from a linear:
    ``opponent`` ``OneDNNLinear``, or the linear itself for torch's own (a 16-bit model where
    oneDNN packs no such weight)."""
    linear = _slice(_widest_layer_linear(model))
    kernels = (contender(linear), opponent(linear))
    ratios: dict[int, float] = {}
    with torch.inference_mode():
        for rows in RACE_ROWS:
            x = torch.randn(rows, linear.in_features, dtype=linear.weight.dtype)
            packed, other = _best_times([partial(kernel, x) for kernel in kernels])
            ratios[rows] = packed / other
    return ratios


def packed_wins(ratios: dict[int, float]) -> bool:
    """The packed kernel unless it is slower over the raced sizes taken together
    (geometric mean of the ratios: each size counts alike, however long it takes)."""
    return math.exp(sum(math.log(r) for r in ratios.values()) / len(ratios)) < 1.0


def describe(ratios: dict[int, float]) -> str:
    return ", ".join(f"{ratio:.2f}x at {rows} rows" for rows, ratio in ratios.items())


def _widest_layer_linear(model: nn.Module) -> nn.Linear:
    linears = [
        module
        for name, module in model.named_modules()
        if type(module) is nn.Linear and not name.endswith("lm_head")
    ]
    if not linears:
        linears = [module for module in model.modules() if type(module) is nn.Linear]
    return max(linears, key=lambda linear: linear.weight.numel())


def _slice(linear: nn.Linear) -> nn.Linear:
    out_features = min(linear.out_features, _MAX_OUT_FEATURES)
    piece = nn.Linear(
        linear.in_features, out_features, bias=linear.bias is not None, dtype=linear.weight.dtype
    )
    with torch.no_grad():
        piece.weight.copy_(linear.weight[:out_features])
        if linear.bias is not None:
            piece.bias.copy_(linear.bias[:out_features])
    return piece


def _best_times(runs: list[Callable[[], object]]) -> list[float]:
    """Each run's best time, the runs taking turns so that the machine's drift touches all."""
    for run in runs:
        run()  # first calls: page faults, oneDNN's JIT
    best = [math.inf] * len(runs)
    for _ in range(_REPEATS):
        for index, run in enumerate(runs):
            began = time.perf_counter()
            run()
            best[index] = min(best[index], time.perf_counter() - began)
    return best

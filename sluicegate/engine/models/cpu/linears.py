"""Which kernel runs a CPU model's linears: ``packed`` (the compiled packed-weight product,
``sluicegate.kernels.cpu_linear``), ``onednn`` (``sluicegate.engine.models.cpu.onednn``),
``pairs`` (bfloat16 models on CPUs with AVX512_BF16: bias-free linears through our kernel on
the bfloat16 dot products, ``sluicegate.kernels.cpu_pair_linear``, others through oneDNN) or
``torch``
(aten's default GEMM, ``nn.Linear`` as loaded).

Float32 models: ``auto`` takes the faster of packed and oneDNN on this machine, raced at
start-up (``sluicegate.engine.models.cpu.linear_race``); either is 1.3-1.9x faster than aten
(``bench/cpu_linear.py``). The maths is the same float32 product; only the summation order
differs, as between any two GEMM libraries.

Bfloat16 and float16 models: the packed product keeps the weights in the model's dtype (half
the bytes of float32 to stream per step) and computes in float32. The other side is
``OneDNNLinear`` where oneDNN packs that dtype on this CPU (bfloat16 with AVX-512: the same
16-bit dot products as torch's own linear, without reordering the weight on every call), else
torch's own linear (``onednn`` then means torch's). ``auto`` races the two the same way, on
the model's own dtype; where oneDNN wins on a bfloat16 model and the CPU has the bfloat16
dot products, ``auto`` then races ``pairs`` against oneDNN the same way.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from sluicegate.engine.models.cpu.linear_race import describe, packed_wins, race
from sluicegate.engine.models.cpu.onednn import OneDNNLinear, packs
from sluicegate.engine.models.cpu.packed_linear import PackedLinear
from sluicegate.engine.models.cpu.pair_linear import PairLinear, pairs_take
from sluicegate.engine.models.cpu.split_mlp import split_gated_mlps
from sluicegate.engine.models.cpu.threads import serial_rows
from sluicegate.engine.models.layers import GatedMLP
from sluicegate.kernels import cpu_ops, cpu_pair_linear

CPU_LINEARS = ("auto", "packed", "onednn", "pairs", "torch")

logger = logging.getLogger(__name__)


_HALF_DTYPES = (torch.bfloat16, torch.float16)


def _cpu_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype of the model's ``nn.Linear`` parameters where they are on the CPU and share
    one (a quantized model's projections are linears of their own, with other dtypes: only
    its dense linears, the LM head, are swapped)."""
    params = [p for m in model.modules() if type(m) is nn.Linear for p in m.parameters()]
    dtypes = {p.dtype for p in params}
    if not params or len(dtypes) != 1 or any(p.device.type != "cpu" for p in params):
        return None
    return dtypes.pop()


def resolve_cpu_linears(requested: str, model: nn.Module) -> str:
    """The kernel ``requested`` means for ``model``: ``torch`` unless the model is float32,
    bfloat16 or float16 on the CPU; ``auto`` the fastest this machine has."""
    if requested not in CPU_LINEARS:
        raise ValueError(f"unknown cpu_linears {requested!r}; choose one of {CPU_LINEARS}")
    dtype = _cpu_dtype(model)
    if requested == "torch" or dtype not in (torch.float32, *_HALF_DTYPES):
        return "torch"
    if requested == "pairs":
        if dtype != torch.bfloat16 or not cpu_pair_linear.available():
            raise ValueError(
                "cpu_linears='pairs' needs a bfloat16 model and a CPU with AVX512_BF16"
            )
        return "pairs"
    from sluicegate.kernels import cpu_linear

    packed, onednn = cpu_linear.available(), torch.backends.mkldnn.is_available()
    if requested == "packed" and not packed:
        raise ValueError("cpu_linears='packed' needs the CPU kernels built with AVX2 and FMA")
    if dtype in _HALF_DTYPES:
        return _resolve_half(requested, model, dtype, packed)
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


def _resolve_half(requested: str, model: nn.Module, dtype: torch.dtype, packed: bool) -> str:
    name = str(dtype).removeprefix("torch.")
    onednn = "onednn" if packs(dtype) else "torch"
    if requested == "packed":
        return "packed"
    if requested == "onednn":
        if onednn == "torch":
            logger.info(
                "cpu_linears='onednn' on a %s model: oneDNN packs no such weight on this "
                "CPU, so torch's own linear",
                name,
            )
        return onednn
    if not packed:
        logger.info("CPU linears of a %s model: %s (no packed product here)", name, onednn)
        return onednn
    ratios = race(model, OneDNNLinear if onednn == "onednn" else lambda linear: linear)
    kind = "packed" if packed_wins(ratios) else onednn
    logger.info(
        "CPU linears of a %s model raced, the packed product's time over %s's: %s; %s",
        name,
        onednn,
        describe(ratios),
        kind,
    )
    if kind == "onednn" and dtype == torch.bfloat16 and cpu_pair_linear.available():
        ratios = race(model, OneDNNLinear, contender=PairLinear)
        if packed_wins(ratios):
            kind = "pairs"
        logger.info("bfloat16 dot products' time over oneDNN's: %s; %s", describe(ratios), kind)
    return kind


def swap_cpu_linears(model: nn.Module, kind: str) -> int:
    """Replace every ``nn.Linear`` of a loaded model in place with ``kind``'s module (from
    ``resolve_cpu_linears``); returns how many."""
    replacement = {"packed": PackedLinear, "onednn": OneDNNLinear, "pairs": OneDNNLinear}.get(kind)
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
    if kind in ("onednn", "pairs"):
        # A 16-bit gated MLP, with the output projection before it where it can: two column
        # halves on two threads in one parallel region (sluicegate.engine.models.cpu.split_mlp).
        swapped += split_gated_mlps(model, pairs=kind == "pairs")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear:
                continue
            if kind == "pairs" and pairs_take(child):
                setattr(parent, name, PairLinear(child))
            else:
                setattr(parent, name, replacement(child))
            swapped += 1
    return swapped


def choose_threads(model: nn.Module, dtype: torch.dtype) -> dict[str, int]:
    """Time each distinct shape of the model's swapped linears, and its gated MLPs' SiLU x mul
    (in ``dtype``, the model's), on one thread and on all
    (``sluicegate.engine.models.cpu.threads``); set each module's rows to run on one thread.
    Returns those rows per shape, named for the log."""
    chosen: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, (OneDNNLinear, PackedLinear, PairLinear)):
            gated = isinstance(module, PackedLinear) and module.packed.gated
            name = f"{module.in_features}x{module.out_features}{' gated' if gated else ''}"
            if name not in chosen:
                chosen[name] = serial_rows(module, module.in_features, module.input_dtype)
            module.serial_rows = chosen[name]
        elif (
            isinstance(module, GatedMLP)
            and not module.gate_up_applies_activation
            and module.split_product is None
        ):
            width = 2 * module.intermediate_size
            if not cpu_ops.supports(torch.empty(0, dtype=dtype)):
                continue
            name = f"SiLU x mul of {width}"
            if name not in chosen:
                chosen[name] = serial_rows(cpu_ops.silu_and_mul, width, dtype)
            module.activation_serial_rows = chosen[name]
    return chosen


def describe_threads(chosen: dict[str, int]) -> str:
    return ", ".join(
        f"{name} up to {rows} rows" if rows else f"{name} never" for name, rows in chosen.items()
    )

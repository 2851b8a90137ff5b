"""Quantized checkpoints of a tiny random Llama (hidden 128, so that groups of 128 fit),
made here: compressed-tensors' own compressor writes its formats (as llmcompressor saves
them); the fp8 (HF/vLLM), AWQ and GPTQ tensors are packed by hand from their documented
layouts (AutoAWQ's ``WQLinear_GEMM.from_linear``, AutoGPTQ's ``QuantLinear.pack``), since no
CPU tool here writes them.

``reference_weights`` reads any of them back through ``sluicegate.kernels.quant_reference``:
the float32 weight each quantized linear stands for.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from sluicegate.engine.models.quant.scheme import QuantScheme, parse_quantization
from sluicegate.kernels import quant_reference as ref

GROUP = 128
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
# Formats by name: what the tests are parametrized over.
FORMATS = (
    "ct-fp8-dynamic",
    "ct-fp8-block",
    "ct-w8a16",
    "ct-w4a16",
    "ct-w4a16-asym",
    "fp8-block",
    "fp8-tensor",
    "awq",
    "gptq",
    "gptq-act-order",
    "gptq-8bit",
)
# compressed-tensors presets behind the ct-* formats.
_PRESETS = {
    "ct-fp8-dynamic": "FP8_DYNAMIC",
    "ct-fp8-block": "FP8_BLOCK",
    "ct-w8a16": "W8A16",
    "ct-w4a16": "W4A16",
    "ct-w4a16-asym": "W4A16_ASYM",
}


def is_linear(name: str) -> bool:
    return any(f".{linear}." in name for linear in _LINEARS)


def compress(base: Path, folder: Path, preset: str, group_size: int | None = None) -> None:
    """compressed-tensors' ``preset`` scheme (FP8_DYNAMIC, W4A16...) of ``base``, in bf16;
    ``group_size`` replaces the preset's (compressed-tensors takes only groups that divide
    every projection's inputs)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )
    from compressed_tensors.quantization.utils import calculate_qparams

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    if group_size is not None:
        scheme.weights.group_size = group_size
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    apply_quantization_config(model, config, show_progress=False)
    # Min-max scales, as llmcompressor's default observer computes them from the weights.
    for module in model.modules():
        args = getattr(getattr(module, "quantization_scheme", None), "weights", None)
        if args is None:
            continue
        weight = module.weight.float()
        if args.strategy == "tensor":
            low, high = weight.min().reshape(1), weight.max().reshape(1)
        elif args.strategy == "channel":
            low, high = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
        elif args.strategy == "group":
            grouped = weight.unflatten(1, (-1, args.group_size))
            low, high = grouped.amin(-1), grouped.amax(-1)
        else:  # blocks
            blocks = _blocks(weight, tuple(args.block_structure))
            low, high = blocks.amin((1, 3)), blocks.amax((1, 3))
        scale, zero = calculate_qparams(low, high, args)
        module.weight_scale.data.copy_(scale)
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(folder)
    compressor.update_config(str(folder))


def _blocks(weight: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[row blocks, rows, column blocks, columns]; the last blocks zero-padded (a layer
    narrower than a block, as this model's k/v projections, has one short block)."""
    rows, cols = weight.shape
    padded = torch.nn.functional.pad(weight, (0, -cols % block[1], 0, -rows % block[0]))
    return padded.unflatten(0, (-1, block[0])).unflatten(2, (-1, block[1]))


def _fp8(weight: torch.Tensor, block: tuple[int, int] | None) -> dict[str, torch.Tensor]:
    finfo = torch.finfo(torch.float8_e4m3fn)
    weight = weight.float()
    if block is None:
        scale = weight.abs().max() / finfo.max
        return {"weight": (weight / scale).to(torch.float8_e4m3fn), "weight_scale": scale}
    rows, cols = weight.shape
    scale = _blocks(weight, block).abs().amax((1, 3)) / finfo.max
    expanded = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    quantized = (weight / expanded[:rows, :cols]).clamp(finfo.min, finfo.max)
    return {"weight": quantized.to(torch.float8_e4m3fn), "weight_scale_inv": scale}


def _pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """AutoGPTQ's packing along dim 0: row r of the result holds rows r*k .. r*k+k-1 of
    ``values`` (k = 32 / bits), the first in the lowest bits."""
    per_word = 32 // bits
    values = values.to(torch.int32)
    packed = torch.zeros(values.shape[0] // per_word, values.shape[1], dtype=torch.int32)
    for j in range(per_word):
        packed |= values[j::per_word] << (bits * j)
    return packed


def _pack_awq(values: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's GEMM packing along dim 1: nibble i of word c holds column 8c + order[i]."""
    values = values.to(torch.int32)
    packed = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int32)
    for i, column in enumerate(ref.AWQ_ORDER):
        packed |= values[:, column::8] << (4 * i)
    return packed


def _awq(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Asymmetric 4-bit groups of the input dimension, AutoAWQ's min-max form."""
    w = weight.float().T  # [in, out], AWQ's orientation
    grouped = w.unflatten(0, (-1, GROUP))
    low, high = grouped.amin(1), grouped.amax(1)  # [groups, out]
    scales = ((high - low).clamp(min=1e-5) / 15).half()
    zeros = (-low / scales.float()).round().clamp(0, 15)
    codes = (grouped / scales.float()[:, None] + zeros[:, None]).round().clamp(0, 15).flatten(0, 1)
    return {"qweight": _pack_awq(codes), "qzeros": _pack_awq(zeros), "scales": scales}


def _gptq(weight: torch.Tensor, bits: int, act_order: bool) -> dict[str, torch.Tensor]:
    """Symmetric groups (zero at mid-range); with ``act_order`` the groups are taken over a
    permutation of the inputs, as GPTQ's descending-activation order makes them."""
    w = weight.float().T  # [in, out]
    inputs = w.shape[0]
    order = torch.randperm(inputs) if act_order else torch.arange(inputs)
    g_idx = torch.empty(inputs, dtype=torch.int32)
    g_idx[order] = (torch.arange(inputs) // GROUP).to(torch.int32)
    mid, top = 1 << (bits - 1), (1 << bits) - 1
    groups = inputs // GROUP
    scales = torch.stack(
        [w[g_idx == g].abs().amax(0) / (mid - 0.5) for g in range(groups)]
    ).half()  # [groups, out]
    per_input = scales.float()[g_idx.long()]
    codes = (w / per_input + mid).round().clamp(0, top)
    # Stored one less than the zero point: the "gptq" checkpoint_format.
    zeros = torch.full((groups, w.shape[1]), mid - 1)
    return {
        "qweight": _pack_rows(codes, bits),
        "qzeros": _pack_rows(zeros.T, bits).T.contiguous(),
        "scales": scales,
        "g_idx": g_idx,
    }


_HAND_CONFIGS: dict[str, dict[str, object]] = {
    "fp8-block": {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    },
    "fp8-tensor": {"quant_method": "fp8", "activation_scheme": "dynamic"},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm"},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False},
    "gptq-act-order": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True},
    "gptq-8bit": {"quant_method": "gptq", "bits": 8, "group_size": GROUP, "desc_act": False},
}


def make_checkpoint(base: Path, folder: Path, fmt: str) -> None:
    """``fmt`` (one of FORMATS) of the dense checkpoint ``base``, written to ``folder``."""
    if fmt in _PRESETS:
        compress(base, folder, _PRESETS[fmt])
    else:
        _by_hand(base, folder, fmt)
    for name in TOKENIZER_FILES:
        if (base / name).is_file():
            shutil.copy(base / name, folder / name)


def _by_hand(base: Path, folder: Path, fmt: str) -> None:
    torch.manual_seed(7)
    quantize: Callable[[torch.Tensor], dict[str, torch.Tensor]] = {
        "fp8-block": lambda w: _fp8(w, (128, 128)),
        "fp8-tensor": lambda w: _fp8(w, None),
        "awq": _awq,
        "gptq": lambda w: _gptq(w, 4, False),
        "gptq-act-order": lambda w: _gptq(w, 4, True),
        "gptq-8bit": lambda w: _gptq(w, 8, False),
    }[fmt]
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(base / "model.safetensors"), framework="pt") as dense:
        for name in dense.keys():
            tensor = dense.get_tensor(name)
            if is_linear(name) and name.endswith(".weight"):  # biases stay dense
                prefix = name.removesuffix(".weight")
                for leaf, value in quantize(tensor).items():
                    tensors[f"{prefix}.{leaf}"] = value.contiguous()
            else:
                tensors[name] = tensor
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((base / "config.json").read_text())
    config["quantization_config"] = _HAND_CONFIGS[fmt]
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def scheme_of(folder: Path) -> QuantScheme:
    scheme = parse_quantization(
        json.loads((folder / "config.json").read_text())["quantization_config"]
    )
    assert scheme is not None
    return scheme


def checkpoint_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as shard:
            tensors.update({name: shard.get_tensor(name) for name in shard.keys()})
    return tensors


def reference_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Each quantized linear's float32 weight by its checkpoint module name, through
    ``quant_reference`` alone."""
    scheme = scheme_of(folder)
    tensors = checkpoint_tensors(folder)
    modules = sorted({name.rpartition(".")[0] for name in tensors if is_linear(name)})
    weights = {}
    for module in modules:
        t = {leaf: tensors[f"{module}.{leaf}"] for leaf in scheme.tensors}
        if scheme.is_fp8:
            weights[module] = ref.dequantize_fp8(t["weight"], t[scheme.fp8_scale], scheme.block)
        elif scheme.layout == "pack-quantized":
            weights[module] = ref.dequantize_pack_quantized(
                t["weight_packed"],
                t["weight_scale"],
                t["weight_shape"],
                scheme.bits,
                scheme.group_size,
                t.get("weight_zero_point"),
            )
        elif scheme.layout == "awq":
            weights[module] = ref.dequantize_awq(
                t["qweight"], t["qzeros"], t["scales"], scheme.group_size or 0
            )
        else:
            weights[module] = ref.dequantize_gptq(
                t["qweight"], t["qzeros"], t["scales"], t["g_idx"], scheme.bits, scheme.zero_offset
            )
    return weights


def dequantized_model(folder: Path, base: Path) -> torch.nn.Module:
    """transformers' Llama in float32 holding the reference weights (and rounding the
    activations to fp8 where the scheme does): what the quantized checkpoint means,
    computed densely."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    state = model.state_dict()
    scheme = scheme_of(folder)
    for module, weight in reference_weights(folder).items():
        state[f"{module}.weight"].copy_(weight)
        if scheme.fp8_activations:
            model.get_submodule(module).register_forward_pre_hook(
                lambda _, args: (ref.fake_quantize_fp8(args[0], scheme.activation_group),)
            )
    return model

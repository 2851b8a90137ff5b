"""What a checkpoint's ``quantization_config`` asks for, read into one ``QuantScheme``, or a
refusal naming the part of it that is not served."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The checkpoint tensors one quantized linear of each integer layout stores, beside its bias
# (an fp8 one: its weight and its scale, see QuantScheme.tensors).
LAYOUT_TENSORS: dict[str, tuple[str, ...]] = {
    "pack-quantized": ("weight_packed", "weight_scale", "weight_shape"),
    "awq": ("qweight", "qzeros", "scales"),
    "gptq": ("qweight", "qzeros", "scales", "g_idx"),
}


class UnsupportedQuantizationError(ValueError):
    """A quantized checkpoint whose scheme this engine does not serve."""


@dataclass(frozen=True)
class QuantScheme:
    method: str  # the config's quant_method
    layout: str  # "fp8" or a key of LAYOUT_TENSORS
    bits: int
    # Weights per scale along the input dimension; None: one scale per output row (or tensor).
    group_size: int | None = None
    # fp8 blocks (rows, columns) of one scale, where the checkpoint scales blocks.
    block: tuple[int, int] | None = None
    # HF's block-scaled fp8 names its scales weight_scale_inv (they multiply all the same).
    fp8_scale: str = "weight_scale"
    symmetric: bool = True
    act_order: bool = False
    # What GPTQ's stored zero points lack (1 in its original ``gptq`` format).
    zero_offset: int = 0
    # Dynamic fp8 activations, emulated (``quant_reference.fake_quantize_fp8``): per token,
    # or per group of this many columns of a token.
    fp8_activations: bool = False
    activation_group: int | None = None

    @property
    def tensors(self) -> tuple[str, ...]:
        if self.is_fp8:
            return ("weight", self.fp8_scale)
        names = LAYOUT_TENSORS[self.layout]
        if self.layout == "pack-quantized" and not self.symmetric:
            names += ("weight_zero_point",)
        return names

    @property
    def is_fp8(self) -> bool:
        return self.layout == "fp8"

    def describe(self) -> str:
        if self.is_fp8:
            granularity = (
                f"{self.block[0]}x{self.block[1]} blocks" if self.block else "tensor or channel"
            )
            weights = f"fp8 e4m3 weights, a scale per {granularity}"
        else:
            grouping = f"group of {self.group_size}" if self.group_size else "channel"
            zeros = "symmetric" if self.symmetric else "with zero points"
            weights = f"int{self.bits} weights, a scale per {grouping}, {zeros}"
            if self.act_order:
                weights += ", act-order"
        if not self.fp8_activations:
            activations = "activations in the model's dtype"
        else:
            per = f"{self.activation_group} columns" if self.activation_group else "token"
            activations = f"activations rounded to fp8 dynamically, a scale per {per}"
        return f"{self.method} ({self.layout}): {weights}; {activations}"


def parse_quantization(raw: dict[str, Any] | None) -> QuantScheme | None:
    """The scheme of a config.json's ``quantization_config`` (None: not quantized)."""
    if not raw:
        return None
    method = str(raw.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _compressed_tensors(raw)
    if method == "fp8":
        return _fp8(raw)
    if method == "awq":
        return _awq(raw)
    if method == "gptq":
        return _gptq(raw)
    raise UnsupportedQuantizationError(
        f"quantization method {method or '(none)'!r} is not served; "
        "served: compressed-tensors, fp8, awq, gptq"
    )


def _refuse(method: str, what: str) -> UnsupportedQuantizationError:
    return UnsupportedQuantizationError(f"{method} checkpoint with {what} is not served")


def _fp8(raw: dict[str, Any]) -> QuantScheme:
    activations = raw.get("activation_scheme", "dynamic")
    if activations != "dynamic":
        raise _refuse("fp8", f"activation_scheme {activations!r} (only dynamic)")
    block = raw.get("weight_block_size")
    if block is None:
        # Per token where vLLM scales the whole batch at once: a request's tokens then do
        # not depend on which others share its step.
        return QuantScheme("fp8", "fp8", 8, fp8_activations=True)
    if len(block) != 2 or min(block) < 1:
        raise _refuse("fp8", f"weight_block_size {block!r}")
    return QuantScheme(
        "fp8",
        "fp8",
        8,
        block=(int(block[0]), int(block[1])),
        fp8_scale="weight_scale_inv",
        fp8_activations=True,
        activation_group=int(block[1]),
    )


def _awq(raw: dict[str, Any]) -> QuantScheme:
    bits = raw.get("bits", raw.get("w_bit"))
    version = str(raw.get("version", "gemm")).lower()
    group = _group_size("awq", raw.get("group_size", raw.get("q_group_size")))
    if version != "gemm":
        raise _refuse("awq", f"version {version!r} (only AutoAWQ's gemm packing)")
    if bits != 4:
        raise _refuse("awq", f"{bits}-bit weights (only 4)")
    if raw.get("zero_point", True) is False:
        raise _refuse("awq", "zero_point false")
    return QuantScheme("awq", "awq", 4, group_size=group, symmetric=False)


def _gptq(raw: dict[str, Any]) -> QuantScheme:
    bits = raw.get("bits")
    if bits not in (4, 8):
        raise _refuse("gptq", f"{bits}-bit weights (only 4 and 8)")
    checkpoint_format = str(raw.get("checkpoint_format", "gptq")).lower()
    offsets = {"gptq": 1, "gptq_v2": 0}
    if checkpoint_format not in offsets:
        raise _refuse("gptq", f"checkpoint_format {checkpoint_format!r} (only gptq, gptq_v2)")
    return QuantScheme(
        "gptq",
        "gptq",
        bits,
        group_size=_group_size("gptq", raw.get("group_size", 128)),
        symmetric=bool(raw.get("sym", True)),
        act_order=bool(raw.get("desc_act", False)),
        zero_offset=offsets[checkpoint_format],
    )


def _group_size(method: str, value: Any) -> int | None:
    if value in (None, -1, 0):
        return None
    if not isinstance(value, int) or value < 1:
        raise _refuse(method, f"group size {value!r}")
    return value


def _compressed_tensors(raw: dict[str, Any]) -> QuantScheme:
    method = "compressed-tensors"
    if raw.get("kv_cache_scheme"):
        raise _refuse(method, "a quantized KV cache (kv_cache_scheme)")
    if raw.get("transform_config"):
        raise _refuse(method, "transforms (transform_config)")
    groups = list((raw.get("config_groups") or {}).values())
    if not groups:
        raise _refuse(method, "no config_groups")
    schemes = {_ct_group(group, raw.get("format")) for group in groups}
    if len(schemes) > 1:
        raise _refuse(method, "config groups of different schemes")
    return schemes.pop()


def _ct_group(group: dict[str, Any], default_format: str | None) -> QuantScheme:
    method = "compressed-tensors"
    fmt = group.get("format") or default_format
    weights = group.get("weights") or {}
    inputs = group.get("input_activations")
    if group.get("output_activations"):
        raise _refuse(method, "quantized output activations")
    kind, bits = weights.get("type"), weights.get("num_bits")
    strategy = weights.get("strategy")
    if kind == "float" and bits == 8:
        if fmt != "float-quantized":
            raise _refuse(method, f"fp8 weights in format {fmt!r} (only float-quantized)")
        activations = _ct_fp8_activations(inputs)
        if strategy in ("tensor", "channel"):
            return QuantScheme(method, "fp8", 8, **activations)
        if strategy == "block":
            rows, cols = weights["block_structure"]
            return QuantScheme(method, "fp8", 8, block=(int(rows), int(cols)), **activations)
        raise _refuse(method, f"fp8 weights per {strategy!r}")
    if kind == "int" and bits in (4, 8):
        if fmt != "pack-quantized":
            raise _refuse(method, f"int weights in format {fmt!r} (only pack-quantized)")
        if inputs:
            raise _refuse(method, f"activations {_args(inputs)} (only 16-bit with int weights)")
        if strategy not in ("group", "channel"):
            raise _refuse(method, f"int weights per {strategy!r} (only group or channel)")
        if weights.get("actorder") not in (None, "static", "weight"):
            # Group act-order keeps g_idx tensors this layout does not read.
            raise _refuse(method, f"actorder {weights.get('actorder')!r}")
        group = _group_size(method, weights.get("group_size")) if strategy == "group" else None
        return QuantScheme(
            method,
            "pack-quantized",
            bits,
            group_size=group,
            symmetric=bool(weights.get("symmetric", True)),
        )
    raise _refuse(method, f"weights {_args(weights)}")


def _ct_fp8_activations(inputs: dict[str, Any] | None) -> dict[str, Any]:
    if not inputs:
        return {}
    strategy = inputs.get("strategy")
    served = (
        inputs.get("type") == "float"
        and inputs.get("num_bits") == 8
        and inputs.get("dynamic") is True
        and strategy in ("token", "group")
    )
    if not served:
        raise _refuse(
            "compressed-tensors",
            f"activations {_args(inputs)} (only dynamic fp8 per token or group, or none)",
        )
    group = inputs.get("group_size") if strategy == "group" else None
    return {"fp8_activations": True, "activation_group": group}


def _args(args: dict[str, Any]) -> str:
    return f"{args.get('type')}{args.get('num_bits')} per {args.get('strategy')}"

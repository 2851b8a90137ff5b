"""Quantized checkpoints through the native loader: each linear keeps its weights quantized
and dequantizes to exactly what ``quant_reference`` reads from the checkpoint; whole-model
logits match transformers (its own compressed-tensors loading where it has one on a CPU,
else the reference weights run densely in float32); the model takes fewer bytes than bf16;
schemes not served are refused, by name."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from sluicegate.engine.models import UnsupportedModelError, load_model
from sluicegate.engine.models.llama import LlamaForCausalLM
from sluicegate.engine.models.quant import linear as quant_linear
from sluicegate.engine.models.quant.linear import QuantizedLinear, QuantizedProjection
from sluicegate.kernels import quant_dequant
from tests.engine.models.quant.checkpoints import FORMATS, dequantized_model, reference_weights
from tests.engine.models.test_models import native_logits

CPU = torch.device("cpu")
TOKENS = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11, 300, 2, 19, 77, 150, 31]
# transformers + compressed-tensors decompress these on a CPU (its asymmetric
# pack-quantized zero points and the fp8 blocks do not load there).
TRANSFORMERS_LOADS = ("ct-fp8-dynamic", "ct-w8a16", "ct-w4a16")
# Logits are ~N(0, 10) for this model; float32 GEMMs of the same weights in another
# summation order differ by ~1e-5 of that.
ATOL = 2e-3


def quantized_linears(model: torch.nn.Module) -> dict[str, QuantizedLinear]:
    """Each checkpoint linear's QuantizedLinear, by its checkpoint module name."""
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantizedProjection):
            assert isinstance(model, LlamaForCausalLM)
            for (checkpoint_name, _), part in zip(
                model.projection_parts(name), module.parts, strict=True
            ):
                found[checkpoint_name] = part
    return found


@pytest.mark.parametrize("path", ["compiled", "torch"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_equals_reference_exactly(
    fmt: str, path: str, quantized: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the C++ dequantization (where the CPU kernels build) and through torch's."""
    if path == "torch":
        monkeypatch.setattr(quant_dequant, "supports", lambda _: False)
    else:
        assert quant_dequant.supports(torch.empty(0)), "the CPU kernels are built here"
    folder = quantized(fmt)
    model = load_model(folder, CPU, "float32")
    linears = quantized_linears(model)
    expected = reference_weights(folder)
    assert set(linears) == set(expected) and len(expected) == 14
    for name, linear in linears.items():
        assert torch.equal(linear.dequantize(), expected[name]), name
        # Row blocks, as forward takes them on a large layer, are slices of the same weight.
        assert torch.equal(linear.dequantize(3, 40), expected[name][3:40]), name


def parameter_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_model_is_smaller_than_bf16(
    fmt: str, quantized: Callable[[str], Path], quant_base: Path
) -> None:
    dense = parameter_bytes(load_model(quant_base, CPU, "bfloat16"))
    model = load_model(quantized(fmt), CPU, "bfloat16")
    linears = quantized_linears(model)
    quantized_bytes = sum(parameter_bytes(linear) for linear in linears.values())
    dense_linear_bytes = sum(
        2 * linear.in_features * linear.out_features for linear in linears.values()
    )
    # The stored weights: 1 byte a weight (fp8, int8) or half of one (int4), plus scales.
    per_weight = 0.5 if "w4" in fmt or fmt in ("awq", "gptq", "gptq-act-order") else 1
    assert quantized_bytes < dense_linear_bytes * (per_weight + 0.1) / 2
    assert parameter_bytes(model) < dense


def engine_logits(folder: Path) -> torch.Tensor:
    """Logits of TOKENS from the second position on: the first token prefilled, then one
    decode step per token, through the paged KV cache."""
    return native_logits(folder, TOKENS, 1, dtype="float32")


@pytest.mark.parametrize("fmt", FORMATS)
def test_logits_match_the_dequantized_model(
    fmt: str, quantized: Callable[[str], Path], quant_base: Path
) -> None:
    folder = quantized(fmt)
    dense = dequantized_model(folder, quant_base)
    with torch.inference_mode():
        expected = dense(torch.tensor([TOKENS])).logits[0]
    torch.testing.assert_close(engine_logits(folder), expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("fmt", TRANSFORMERS_LOADS)
def test_logits_match_transformers_compressed_tensors(
    fmt: str, quantized: Callable[[str], Path]
) -> None:
    folder = quantized(fmt)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = hf(torch.tensor([TOKENS])).logits[0].float()
    torch.testing.assert_close(engine_logits(folder), expected, atol=ATOL, rtol=0)


def _with_config(folder: Path, target: Path, **changes: object) -> Path:
    shutil.copytree(folder, target)
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"].update(changes)
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize(
    ("fmt", "changes", "named"),
    [
        ("awq", {"version": "gemv"}, "version 'gemv'"),
        ("awq", {"bits": 3}, "3-bit"),
        ("gptq", {"bits": 3}, "3-bit"),
        ("gptq", {"checkpoint_format": "marlin"}, "checkpoint_format 'marlin'"),
        ("fp8-tensor", {"activation_scheme": "static"}, "activation_scheme 'static'"),
        ("awq", {"quant_method": "bitsandbytes"}, "'bitsandbytes'"),
        (
            "ct-w8a16",
            {
                "config_groups": {
                    "group_0": {
                        "targets": ["Linear"],
                        "format": "int-quantized",
                        "weights": {"type": "int", "num_bits": 8, "strategy": "channel"},
                        "input_activations": {"type": "int", "num_bits": 8, "dynamic": True},
                    }
                }
            },
            "int-quantized",
        ),
        (
            "ct-w4a16",
            {
                "config_groups": {
                    "group_0": {
                        "targets": ["Linear"],
                        "format": "pack-quantized",
                        "weights": {
                            "type": "int",
                            "num_bits": 4,
                            "strategy": "group",
                            "group_size": 128,
                        },
                        "input_activations": {
                            "type": "int",
                            "num_bits": 8,
                            "strategy": "token",
                            "dynamic": True,
                        },
                    }
                }
            },
            "activations int8 per token",
        ),
        ("ct-w4a16", {"kv_cache_scheme": {"num_bits": 8, "type": "float"}}, "kv_cache_scheme"),
    ],
)
def test_unsupported_schemes_are_refused_by_name(
    fmt: str,
    changes: dict[str, object],
    named: str,
    quantized: Callable[[str], Path],
    tmp_path: Path,
) -> None:
    folder = _with_config(quantized(fmt), tmp_path / "model", **changes)
    with pytest.raises(UnsupportedModelError, match=named.replace("(", r"\(")):
        load_model(folder, CPU, "float32")


def test_a_group_size_that_does_not_fit_is_refused(
    quantized: Callable[[str], Path], tmp_path: Path
) -> None:
    # 4-bit codes two a byte need an even number of inputs; 129 would not pack.
    folder = _with_config(quantized("gptq"), tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    config["hidden_size"] = 129
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="int4 codes of 129 input features"):
        load_model(folder, CPU, "float32")


@pytest.mark.parametrize("fmt", ["ct-fp8-dynamic", "ct-w4a16", "awq", "gptq-act-order"])
def test_qwen2_biases_and_tied_embeddings(
    fmt: str, qwen2_quantized: Callable[[str], Path], qwen2_quant_base: Path
) -> None:
    """Qwen2's q/k/v biases stay dense beside the quantized q/k/v, fused in order; the tied
    LM head is the embedding."""
    folder = qwen2_quantized(fmt)
    model = load_model(folder, CPU, "float32")
    expected = reference_weights(folder)
    linears = quantized_linears(model)
    assert set(linears) == set(expected) and len(expected) == 14
    assert all(torch.equal(linears[name].dequantize(), w) for name, w in expected.items())
    dense = dequantized_model(folder, qwen2_quant_base)
    qkv = model.model.layers[1].self_attn.qkv_proj
    attention = dense.model.layers[1].self_attn
    biases = [attention.q_proj.bias, attention.k_proj.bias, attention.v_proj.bias]
    assert isinstance(qkv, QuantizedProjection) and torch.equal(qkv.bias, torch.cat(biases))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with torch.inference_mode():
        reference = dense(torch.tensor([TOKENS])).logits[0]
    torch.testing.assert_close(engine_logits(folder), reference, atol=ATOL, rtol=0)


def test_the_transformers_backend_refuses_quantized_checkpoints(
    quantized: Callable[[str], Path],
) -> None:
    with pytest.raises(UnsupportedModelError, match=r"quant_method 'awq'.*native models only"):
        load_model(quantized("awq"), CPU, "float32", model_impl="transformers")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("fmt", ["ct-fp8-dynamic", "fp8-block", "awq", "gptq-act-order"])
def test_half_precision_stays_close_to_float32(
    fmt: str, dtype: str, quantized: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """16-bit activations over the same quantized weights (decode steps through the CPU
    kernel's product, the prompt's first token through dequantize-then-GEMM): within a tenth
    of the logits' range of float32, as the dense models' own half-precision test asks.

    Rounding activations to fp8 turns 16-bit rounding into whole fp8 steps here and there
    (logits then move by up to ~5 of ~12 on this random model), so the fp8 formats are
    compared with that rounding off: what is checked is the weights' path."""
    if fmt.startswith(("ct-fp8", "fp8")):
        monkeypatch.setattr(quant_linear, "fake_quantize_fp8", lambda x, group: x)
    folder = quantized(fmt)
    full = native_logits(folder, TOKENS, 1, dtype="float32")
    half = native_logits(folder, TOKENS, 1, dtype=dtype)
    assert (half - full).abs().max() < 0.1 * full.abs().max()
    assert torch.equal(half.argmax(-1), full.argmax(-1))


def test_the_dense_lm_head_takes_the_cpu_linears(quantized: Callable[[str], Path]) -> None:
    """The quantized projections are linears of their own; the dense LM head beside them is
    the one nn.Linear the CPU linears' choice swaps."""
    from sluicegate.engine.models.cpu.linears import resolve_cpu_linears, swap_cpu_linears
    from sluicegate.kernels import cpu_linear

    if not cpu_linear.available():
        pytest.skip("the packed CPU linear needs AVX2 and FMA")
    model = load_model(quantized("awq"), CPU, "float32")
    assert resolve_cpu_linears("packed", model) == "packed"
    assert swap_cpu_linears(model, "packed") == 1
    assert type(model.lm_head).__name__ == "PackedLinear"

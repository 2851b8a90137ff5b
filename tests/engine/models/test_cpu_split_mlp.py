"""A 16-bit gated MLP, and a decoder layer's whole tail after its attention, split into column
halves on two threads (``sluicegate.engine.models.cpu.split_mlp``) against the same unsplit,
in torch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from sluicegate.engine.models import load_model
from sluicegate.engine.models.cpu.linears import swap_cpu_linears
from sluicegate.engine.models.cpu.onednn import packs
from sluicegate.engine.models.cpu.split_mlp import (
    COLUMN_SPLIT_ROWS,
    SplitLayerTail,
    SplitMLP,
    split_gated_mlps,
)
from sluicegate.engine.models.layers import GatedMLP, RMSNorm
from sluicegate.kernels.cpu_build import extension

CPU = torch.device("cpu")
DTYPES = [torch.bfloat16, torch.float16]


def _needs(dtype: torch.dtype) -> None:
    if extension() is None:
        pytest.skip("the CPU kernels are not built here")
    if not packs(dtype):
        pytest.skip(f"oneDNN packs no {dtype} weight on this CPU")


def _mlp(dtype: torch.dtype, hidden: int = 96, intermediate: int = 160) -> GatedMLP:
    torch.manual_seed(0)
    mlp = GatedMLP(hidden, intermediate, bias=False, act="silu").to(dtype)
    with torch.no_grad():
        for linear in (mlp.gate_up_proj, mlp.down_proj):
            linear.weight.normal_(0, 0.1)
    return mlp


def _unsplit(mlp: GatedMLP, x: torch.Tensor) -> torch.Tensor:
    """The MLP as torch computes it, each product rounded to the dtype as it is stored."""
    gate, up = F.linear(x, mlp.gate_up_proj.weight).split(mlp.intermediate_size, dim=-1)
    return F.linear(F.silu(gate) * up, mlp.down_proj.weight)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 7, 64, COLUMN_SPLIT_ROWS + 5])
def test_split_mlp_matches_the_unsplit_mlp(two_threads: None, dtype: torch.dtype, rows: int):
    _needs(dtype)
    mlp = _mlp(dtype)
    split = SplitMLP(mlp.gate_up_proj, mlp.down_proj)
    x = torch.randn(rows, 96).to(dtype)
    with torch.inference_mode():
        out = split(x)
        expected = _unsplit(mlp, x)
    assert out.dtype == dtype and out.shape == (rows, 96)
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_by_columns_by_rows_and_on_one_thread_agree(two_threads: None, dtype: torch.dtype):
    _needs(dtype)
    mlp = _mlp(dtype)
    split = SplitMLP(mlp.gate_up_proj, mlp.down_proj)
    kernels = extension()
    assert kernels is not None
    x = torch.randn(33, 96).to(dtype)

    def run(by_columns: bool) -> torch.Tensor:
        return kernels.split_mlp(x, split.gate_up_halves, split.down_halves, 160, by_columns)

    with torch.inference_mode():
        by_columns, by_rows = run(True), run(False)
        torch.set_num_threads(1)
        alone = run(True)
    # Each output value is one product over all its inputs whichever thread runs it.
    torch.testing.assert_close(by_columns, by_rows, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(by_columns, alone, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(by_columns, _unsplit(mlp, x), rtol=2e-2, atol=2e-2)


def test_a_failure_inside_the_region_is_raised_not_fatal(two_threads: None) -> None:
    _needs(torch.bfloat16)
    mlp = _mlp(torch.bfloat16)
    split = SplitMLP(mlp.gate_up_proj, mlp.down_proj)
    kernels = extension()
    assert kernels is not None
    wrong_width = torch.randn(4, 80).to(torch.bfloat16)
    for by_columns in (True, False):
        with pytest.raises(RuntimeError), torch.inference_mode():
            kernels.split_mlp(wrong_width, split.gate_up_halves, split.down_halves, 160, by_columns)
    # The pool is still usable after a failed region.
    x = torch.randn(4, 96).to(torch.bfloat16)
    with torch.inference_mode():
        torch.testing.assert_close(split(x), _unsplit(mlp, x), rtol=2e-2, atol=2e-2)


def _tail(dtype: torch.dtype) -> tuple[torch.nn.Linear, RMSNorm, GatedMLP]:
    mlp = _mlp(dtype)
    o_proj = torch.nn.Linear(64, 96, bias=False).to(dtype)
    norm = RMSNorm(96, 1e-5).to(dtype)
    with torch.no_grad():
        o_proj.weight.normal_(0, 0.1)
        norm.weight.normal_(1, 0.2)
    return o_proj, norm, mlp


def _unsplit_tail(
    o_proj: torch.nn.Linear,
    norm: RMSNorm,
    mlp: GatedMLP,
    attn: torch.Tensor,
    residual: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tail as torch computes it: the layers' torch definitions, not the C++ layer ops."""
    residual = residual + F.linear(attn, o_proj.weight)
    return _unsplit(mlp, norm._normalize(residual)), residual


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 7, 64, COLUMN_SPLIT_ROWS + 5])
def test_split_tail_matches_the_unsplit_layer(two_threads: None, dtype: torch.dtype, rows: int):
    _needs(dtype)
    o_proj, norm, mlp = _tail(dtype)
    tail = SplitLayerTail(o_proj, norm, mlp)
    attn, residual = torch.randn(rows, 64).to(dtype), torch.randn(rows, 96).to(dtype)
    stream = residual.clone()
    with torch.inference_mode():
        out, returned = tail(attn, stream)
        expected, expected_residual = _unsplit_tail(o_proj, norm, mlp, attn, residual)
    assert returned is stream  # updated in place, as the unsplit layer's add_rms_norm_
    assert out.dtype == dtype and out.shape == (rows, 96)
    torch.testing.assert_close(stream, expected_residual, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_tail_by_columns_by_rows_and_on_one_thread_agree(
    two_threads: None, dtype: torch.dtype
):
    _needs(dtype)
    tail = SplitLayerTail(*_tail(dtype))
    attn, residual = torch.randn(33, 64).to(dtype), torch.randn(33, 96).to(dtype)
    kernels = extension()
    assert kernels is not None

    def run(by_columns: bool) -> tuple[torch.Tensor, torch.Tensor]:
        stream = residual.clone()
        out = kernels.split_layer_tail(
            attn, stream, tail.o_halves, tail.norm_weight, tail.eps,
            tail.mlp.gate_up_halves, tail.mlp.down_halves, 160, by_columns,
        )  # fmt: skip
        return out, stream

    with torch.inference_mode():
        by_columns, by_rows = run(True), run(False)
        torch.set_num_threads(1)
        alone = run(True)
    # Each value is one product over all its inputs, and each row's norm one pass, whichever
    # thread runs it.
    for other in (by_rows, alone):
        assert torch.equal(other[1], by_columns[1])
        torch.testing.assert_close(other[0], by_columns[0], rtol=1e-2, atol=1e-2)


def test_a_failure_inside_the_tail_is_raised_not_fatal(two_threads: None) -> None:
    _needs(torch.bfloat16)
    o_proj, norm, mlp = _tail(torch.bfloat16)
    tail = SplitLayerTail(o_proj, norm, mlp)
    kernels = extension()
    assert kernels is not None
    wrong_width = torch.randn(4, 80).to(torch.bfloat16)
    for by_columns in (True, False):
        with pytest.raises(RuntimeError), torch.inference_mode():
            kernels.split_layer_tail(
                wrong_width, torch.zeros(4, 96, dtype=torch.bfloat16), tail.o_halves,
                tail.norm_weight, tail.eps, tail.mlp.gate_up_halves, tail.mlp.down_halves, 160,
                by_columns,
            )  # fmt: skip
    attn, residual = torch.randn(4, 64).to(torch.bfloat16), torch.randn(4, 96).to(torch.bfloat16)
    with torch.inference_mode():
        out, _ = tail(attn, residual.clone())
        expected, _ = _unsplit_tail(o_proj, norm, mlp, attn, residual)
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)


def test_a_bfloat16_models_layer_tails_are_split_and_a_float32_ones_not(
    llama_dir: Path, two_threads: None
) -> None:
    _needs(torch.bfloat16)
    model = load_model(llama_dir, CPU, dtype="bfloat16")
    layers = model.model.layers
    x = torch.randn(5, layers[0].mlp.down_proj.out_features, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected_mlp = layers[0].mlp(x)
    # Per layer: the output projection and both MLP products into the tail; the q/k/v
    # product, and the LM head, become OneDNNLinear.
    assert swap_cpu_linears(model, "onednn") == 4 * len(layers) + 1
    for layer in layers:
        assert isinstance(layer.split_tail, SplitLayerTail)
        assert layer.mlp.split_product is layer.split_tail.mlp
        assert not hasattr(layer.self_attn, "o_proj") and not hasattr(layer.mlp, "gate_up_proj")
    with torch.inference_mode():
        # The MLP called alone still computes itself from the tail's halves.
        torch.testing.assert_close(layers[0].mlp(x), expected_mlp, rtol=2e-2, atol=2e-2)

    full = load_model(llama_dir, CPU, dtype="float32")
    assert split_gated_mlps(full) == 0
    torch.set_num_threads(1)
    one_thread = load_model(llama_dir, CPU, dtype="bfloat16")
    assert split_gated_mlps(one_thread) == 0

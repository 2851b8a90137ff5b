"""One thread or all of torch's per CPU product (sluicegate.engine.models.cpu.threads)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from sluicegate.engine.models import load_model
from sluicegate.engine.models.cpu.linears import choose_threads, swap_cpu_linears
from sluicegate.engine.models.cpu.onednn import OneDNNLinear, packs
from sluicegate.engine.models.cpu.packed_linear import PackedLinear
from sluicegate.engine.models.cpu.threads import CALIBRATION_ROWS, on_one_thread, serial_rows
from sluicegate.kernels import cpu_linear, cpu_ops

CPU = torch.device("cpu")


def test_on_one_thread_restores_the_count_also_when_the_run_fails(two_threads: None) -> None:
    seen: list[int] = []

    def run(x: torch.Tensor) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        return x

    on_one_thread(run, torch.zeros(1))

    def fail(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        on_one_thread(fail, torch.zeros(1))
    assert seen == [1]
    assert torch.get_num_threads() == 2


def _costs(serial_work: int, parallel_work: int) -> Callable[[torch.Tensor], None]:
    """A run whose cost depends on the thread count it runs with: a chain of matrix
    products, ``serial_work`` long on one thread, ``parallel_work`` long on more."""
    a = torch.randn(64, 64)

    def run(x: torch.Tensor) -> None:
        steps = serial_work if torch.get_num_threads() == 1 else parallel_work
        y = a
        for _ in range(steps):
            y = y @ a
            y = y / y.norm()

    return run


def test_serial_rows_follows_the_faster_side(two_threads: None) -> None:
    serial_cheap = serial_rows(_costs(1, 40), 8, torch.float32)
    assert serial_cheap == CALIBRATION_ROWS[-1]
    parallel_cheap = serial_rows(_costs(40, 1), 8, torch.float32)
    assert parallel_cheap == 0


def test_serial_rows_is_zero_without_threads_to_spare() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    calls: list[torch.Tensor] = []
    try:
        assert serial_rows(calls.append, 8, torch.float32) == 0
    finally:
        torch.set_num_threads(before)
    assert not calls


def _kernels(dtype: torch.dtype) -> list[type[torch.nn.Module]]:
    kinds: list[type[torch.nn.Module]] = []
    if packs(dtype):
        kinds.append(OneDNNLinear)
    if cpu_linear.available():
        kinds.append(PackedLinear)
    if not kinds:
        pytest.skip(f"neither oneDNN nor the packed product takes {dtype} here")
    return kinds


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_product_on_one_thread_gives_the_same_bits(two_threads: None, dtype: torch.dtype) -> None:
    # Up to CALIBRATION_ROWS[-1] rows the choice changes which thread computes what, not
    # the sums: the decision may differ between two engines, their tokens may not.
    for kind in _kernels(dtype):
        linear = kind(torch.nn.Linear(96, 200, bias=True).to(dtype))
        for rows in (1, 7, CALIBRATION_ROWS[-1]):
            x = torch.randn(rows, 96).to(dtype)
            linear.serial_rows = 0
            parallel = linear(x)
            linear.serial_rows = rows
            serial = linear(x)
            torch.testing.assert_close(serial, parallel, atol=0, rtol=0)
            assert torch.get_num_threads() == 2


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_choose_threads_sets_every_product_and_activation_of_a_model(
    llama_dir: Path, two_threads: None, dtype: str
) -> None:
    model = load_model(llama_dir, CPU, dtype=dtype)
    kind = "onednn" if packs(getattr(torch, dtype)) else "packed"
    if kind == "packed" and not cpu_linear.available():
        pytest.skip("no CPU linear kernel of ours takes this dtype here")
    swap_cpu_linears(model, kind)
    layer = model.model.layers[0]
    x = torch.randn(5, layer.self_attn.qkv_proj.in_features, dtype=getattr(torch, dtype))
    with torch.inference_mode():
        before = layer.mlp(x)
    chosen = choose_threads(model, getattr(torch, dtype))
    assert set(chosen.values()) <= {0, *CALIBRATION_ROWS}
    products = [m for m in model.modules() if isinstance(m, (OneDNNLinear, PackedLinear))]
    assert products
    for module in products:
        # A fused gate/up product is timed apart from a plain one of the same shape.
        gated = isinstance(module, PackedLinear) and module.packed.gated
        name = f"{module.in_features}x{module.out_features}{' gated' if gated else ''}"
        assert module.serial_rows == chosen[name]
    # A split MLP (sluicegate.engine.models.cpu.split_mlp) runs its activation inside.
    if (
        cpu_ops.supports(x)
        and not layer.mlp.gate_up_applies_activation
        and layer.mlp.split_product is None
    ):
        width = 2 * layer.mlp.intermediate_size
        assert layer.mlp.activation_serial_rows == chosen[f"SiLU x mul of {width}"]
        layer.mlp.activation_serial_rows = CALIBRATION_ROWS[-1]
    with torch.inference_mode():
        torch.testing.assert_close(layer.mlp(x), before, atol=0, rtol=0)

"""LoRA adapters on quantized projections: the adapter's delta is added on top of the
quantized product (fp8, int8 and int4 weights kept quantized), row by row in a batch mixing
the adapter and the base model, and the tokens are transformers + peft's on the checkpoint's
reference weights run densely."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from peft import PeftModel

from sluicegate.engine.options import EngineOptions
from sluicegate.engine.serving.core import EngineCore
from tests.engine.lora.adapters import make_adapter
from tests.engine.lora.engine_runs import run_mixed
from tests.engine.models.greedy import transformers_greedy
from tests.engine.models.quant.checkpoints import dequantized_model

PROMPTS = [[5, 17, 42, 99], [3, 250, 7, 64, 128, 11, 300, 2, 19]]
NEW_TOKENS = 10


@pytest.mark.parametrize("fmt", ["ct-fp8-dynamic", "ct-w8a16", "ct-w4a16"])
def test_an_adapter_on_quantized_projections(
    fmt: str, quantized: Callable[[str], Path], quant_base: Path, tmp_path: Path
) -> None:
    folder = quantized(fmt)
    adapter = make_adapter(quant_base, tmp_path / "adapter", seed=51)
    reference = PeftModel.from_pretrained(dequantized_model(folder, quant_base), adapter).eval()
    expected = transformers_greedy(reference, PROMPTS, NEW_TOKENS)
    base_expected = transformers_greedy(dequantized_model(folder, quant_base), PROMPTS, NEW_TOKENS)
    assert expected != base_expected
    core = EngineCore(
        folder, EngineOptions(dtype="float32", device="cpu", num_kv_blocks=64, max_loras=1)
    )
    requests = [(p, name, adapter if name else None) for p in PROMPTS for name in ("a", None)]
    outputs = run_mixed(core, requests, NEW_TOKENS)
    assert outputs == [expected[0], base_expected[0], expected[1], base_expected[1]]

"""Each quantized format served through ``LLM``: greedy tokens equal transformers' greedy
generation from the checkpoint's reference weights run densely in float32, and the engine
says which scheme it found."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from sluicegate.engine import LLM, SamplingParams
from tests.engine.models.greedy import transformers_greedy
from tests.engine.models.quant.checkpoints import FORMATS, dequantized_model

PROMPTS = [[5, 17, 42, 99], [3, 250, 7, 64, 128, 11, 300, 2, 19]]
NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("fmt", FORMATS)
def test_greedy_generation_through_llm(
    fmt: str,
    quantized: Callable[[str], Path],
    quant_base: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    folder = quantized(fmt)
    with caplog.at_level(logging.INFO, logger="sluicegate.engine.models.loader"):
        llm = LLM(str(folder), dtype="float32", device="cpu", num_kv_blocks=64)
    try:
        outputs = llm.generate(PROMPTS, GREEDY)
    finally:
        llm.close()
    assert [o.token_ids for o in outputs] == transformers_greedy(
        dequantized_model(folder, quant_base), PROMPTS, NEW_TOKENS
    )
    found = [r.getMessage() for r in caplog.records if "quantized checkpoint" in r.getMessage()]
    assert len(found) == 1
    assert f"{folder.name}: quantized checkpoint, 8 projections" in found[0]

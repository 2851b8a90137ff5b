"""Speculative decoding with a draft model, end to end on the tiny models: greedy outputs
equal those without speculation, with the target itself as the draft (every draft
accepted) and with a different random model as the draft (most rejected), through prefix
caching, chunked prefill and preemption; the KV cache ends empty; random sampling runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from sluicegate.engine import LLM, AsyncEngine, SamplingParams
from sluicegate.engine.protocol import Structured
from sluicegate.engine.serving.request_options import RequestOptions

NEW_TOKENS = 24
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
SETTINGS: dict[str, dict[str, Any]] = {
    "roomy": dict(num_kv_blocks=64),
    # 16-token chunks, a shared prefix from the cache, too few blocks for all six: some are
    # preempted and recomputed, the draft's cache with the target's.
    "busy": dict(num_kv_blocks=9, max_num_batched_tokens=16, enable_prefix_caching=True),
}


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, 256, (n,), generator=generator).tolist()

    shared = tokens(40)
    return [shared + tokens(9), tokens(5), shared + tokens(17), tokens(30), shared + tokens(1)]


def run(model: Path, **options: Any) -> tuple[list[list[int]], dict[str, Any]]:
    llm = LLM(str(model), device="cpu", dtype="float32", **options)
    outputs = llm.generate(prompts(), GREEDY)
    return [o.token_ids for o in outputs], llm.stats()


@pytest.fixture(scope="module")
def reference(llama_dir: Path) -> list[list[int]]:
    return run(llama_dir, num_kv_blocks=64)[0]


@pytest.mark.parametrize("setting", ["roomy", "busy"])
@pytest.mark.parametrize("draft", ["itself", "other"])
def test_greedy_outputs_equal_those_without_speculation(
    model_dirs: dict[str, Path], reference: list[list[int]], setting: str, draft: str
) -> None:
    draft_dir = model_dirs["llama" if draft == "itself" else "qwen2"]
    spec = {"model": str(draft_dir), "num_speculative_tokens": 3, "disable_by_batch_size": 64}
    tokens, stats = run(model_dirs["llama"], speculative_config=spec, **SETTINGS[setting])
    assert tokens == reference
    assert stats["spec_draft_tokens"] > 0
    if draft == "itself":
        # The same weights propose what the target then picks: one-token forwards and the
        # verifying multi-token forward round alike on these clear-winner models.
        assert stats["spec_acceptance_rate"] == 1.0
    else:
        assert stats["spec_acceptance_rate"] < 0.5
    if setting == "busy":
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert stats["kv_blocks_used"] == 0


def test_random_sampling_with_a_draft_model_keeps_its_own_draws(
    model_dirs: dict[str, Path],
) -> None:
    """Sampled requests (no seed) go through rejection sampling against the draft's
    distribution: every output is as long as asked and within the vocabulary, and some
    drafts are accepted, some not."""
    spec = {"model": str(model_dirs["llama"]), "num_speculative_tokens": 3}
    llm = LLM(str(model_dirs["llama"]), device="cpu", dtype="float32", num_kv_blocks=64,
              speculative_config=spec)  # fmt: skip
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, top_p=0.9, ignore_eos=True)
    outputs = llm.generate(prompts()[:3], params)
    assert all(len(o.token_ids) == NEW_TOKENS for o in outputs)
    assert all(0 <= t < 320 for o in outputs for t in o.token_ids)
    stats = llm.stats()
    assert stats["spec_draft_tokens"] > 0 and 0 < stats["spec_acceptance_rate"] <= 1
    assert stats["kv_blocks_used"] == 0


async def test_n_choices_speculate_each(
    model_dirs: dict[str, Path], reference: list[list[int]]
) -> None:
    """Forked choices share the prompt's blocks, the draft's cache with the target's."""
    spec = {"model": str(model_dirs["llama"]), "num_speculative_tokens": 3}
    async with AsyncEngine(
        model_dirs["llama"], num_kv_blocks=64, speculative_config=spec
    ) as engine:
        choices: list[list[int]] = [[], [], []]
        async for delta in engine.add_request(
            "n", prompt_token_ids=prompts()[1], params=GREEDY, options=RequestOptions(n=3)
        ):
            choices[delta.index].extend(delta.token_ids)
        stats = engine.core.stats()  # type: ignore[union-attr]
    assert choices == [reference[1]] * 3
    assert stats["spec_accepted_tokens"] > 0 and stats["kv_blocks_used"] == 0


def test_grammar_constrained_requests_speculate_with_a_draft_model(
    model_dirs: dict[str, Path],
) -> None:
    """The draft proposes freely; the grammar masks each verified row, so the output is the
    constrained output without speculation."""
    structured = RequestOptions(
        structured=Structured("regex", regex=r"[0-9]{3}-[a-z]{2}( [a-z]+){2,4}")
    )
    params = SamplingParams(max_tokens=30, temperature=0)
    plain = LLM(str(model_dirs["llama"]), dtype="float32", num_kv_blocks=64)
    (want,) = plain.generate(prompts()[1], params, structured)
    spec = {"model": str(model_dirs["qwen2"]), "num_speculative_tokens": 3}
    llm = LLM(str(model_dirs["llama"]), dtype="float32", num_kv_blocks=64,
              speculative_config=spec)  # fmt: skip
    (out,) = llm.generate(prompts()[1], params, structured)
    assert (out.token_ids, out.text) == (want.token_ids, want.text)
    assert llm.stats()["spec_draft_tokens"] > 0


def test_a_draft_with_another_vocabulary_is_refused(tmp_path: Path, llama_dir: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=400, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"vocabulary .* differs"):
        LLM(str(llama_dir), device="cpu", dtype="float32", num_kv_blocks=16,
            speculative_config={"model": str(tmp_path)})  # fmt: skip

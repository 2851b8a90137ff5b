"""Acceptance 1: greedy token ids equal transformers ``generate`` on the same float32 weights,
with and without prefix caching, chunked prefill and preemption in play."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from sluicegate.engine import LLM, SamplingParams

NEW_TOKENS = 48
# Below every test tokenizer's vocabulary (byte-level: 256 bytes + specials + merges).
MAX_TOKEN_ID = 256
PROMPT_LENGTHS = [1, 2, 3, 7, 15, 16, 17, 31, 64, 100, 128, 150, 200, 255, 299, 300]
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


def mixed_prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    return [
        torch.randint(3, MAX_TOKEN_ID, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS
    ]


def shared_prefix_prompts() -> list[list[int]]:
    """Two families of prompts behind one 160-token system prefix, each family adding its own
    48 tokens, then a distinct tail: prefixes shared at two depths, ending mid-block or not."""
    generator = torch.Generator().manual_seed(11)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, MAX_TOKEN_ID, (n,), generator=generator).tolist()

    system = tokens(160)
    families = [system + tokens(48), system + tokens(48)]
    return [families[i % 2] + tokens(1 + 5 * i) for i in range(16)]


def reference(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    """transformers greedy ``generate``, one prompt at a time. EOS is not a stop for it
    (like ``ignore_eos``): min_new_tokens would instead forbid EOS, changing the argmax."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


@pytest.fixture(scope="module")
def references(model_dirs: dict[str, Path]) -> dict[tuple[str, str], list[list[int]]]:
    cache: dict[tuple[str, str], list[list[int]]] = {}

    def get(kind: str, prompt_set: str) -> list[list[int]]:
        if (kind, prompt_set) not in cache:
            prompts = mixed_prompts() if prompt_set == "mixed" else shared_prefix_prompts()
            cache[kind, prompt_set] = reference(model_dirs[kind], prompts)
        return cache[kind, prompt_set]

    return get  # type: ignore[return-value]


def generated(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate(prompts, GREEDY)
    assert all(o.finish_reason == "length" for o in outputs)
    return [o.token_ids for o in outputs]


KINDS = ["llama", "qwen2", "qwen3"]


@pytest.mark.parametrize("kind", KINDS)
def test_mixed_lengths_together(kind: str, model_dirs: dict[str, Path], references) -> None:
    llm = LLM(str(model_dirs[kind]), num_kv_blocks=512, dtype="float32")
    assert generated(llm, mixed_prompts()) == references(kind, "mixed")
    assert llm.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("kind", KINDS)
def test_prefix_caching_shared_prefixes(kind: str, model_dirs: dict[str, Path], references) -> None:
    llm = LLM(str(model_dirs[kind]), num_kv_blocks=512, enable_prefix_caching=True)
    prompts = shared_prefix_prompts()
    expected = references(kind, "shared")
    assert generated(llm, prompts) == expected
    hits_first_round = llm.stats()["prefix_cache_hits"]
    assert hits_first_round > 0
    # A second round finds every full prompt block cached from the first.
    assert generated(llm, prompts) == expected
    assert llm.stats()["prefix_cache_hits"] - hits_first_round >= 16 * 192


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_prefill(kind: str, model_dirs: dict[str, Path], references) -> None:
    llm = LLM(str(model_dirs[kind]), num_kv_blocks=512, max_num_batched_tokens=40)
    assert generated(llm, mixed_prompts()) == references(kind, "mixed")


@pytest.mark.parametrize("kind", KINDS)
def test_preemption(kind: str, model_dirs: dict[str, Path], references) -> None:
    # The longest request alone needs 22 blocks; 16 together need ~110.
    llm = LLM(str(model_dirs[kind]), num_kv_blocks=32, enable_prefix_caching=False)
    assert generated(llm, mixed_prompts()) == references(kind, "mixed")
    assert llm.stats()["num_preemptions"] > 0


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_compiled_mode(kind: str, model_dirs: dict[str, Path], references) -> None:
    """The torch.compile'd forward (attention as the opaque custom op), with chunked
    prefill, prefix caching and preemption all in play."""
    llm = LLM(
        str(model_dirs[kind]),
        num_kv_blocks=32,
        max_num_batched_tokens=64,
        dtype="float32",
        cpu_compile=True,
    )
    assert generated(llm, mixed_prompts()) == references(kind, "mixed")
    assert llm.stats()["num_preemptions"] > 0


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_async_scheduling(kind: str, model_dirs: dict[str, Path], references) -> None:
    """Each step scheduled and prepared before the previous one's tokens are read (their
    inputs fed on the device), with chunked prefill, prefix caching and preemption."""
    llm = LLM(
        str(model_dirs[kind]),
        num_kv_blocks=32,
        max_num_batched_tokens=64,
        dtype="float32",
        async_scheduling=True,
    )
    assert generated(llm, mixed_prompts()) == references(kind, "mixed")
    assert llm.stats()["num_preemptions"] > 0

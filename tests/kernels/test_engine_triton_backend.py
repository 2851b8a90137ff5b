"""Acceptance 4: the engine, with the Triton attention backend forced through
``SLUICEGATE_ATTENTION_BACKEND`` and run by the interpreter on the CPU, decodes greedily exactly
like transformers ``generate`` on the same float32 weights.

The prompts cover a prompt inside one block, one ending exactly at a block boundary, and a
longer one prefilled in chunks; the second round finds the shared prefix cached, so its
prefill is a chunk after a cached prefix. Shapes are tiny: every kernel program is interpreted.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

NEW_TOKENS = 6
VOCAB_SIZE = 300
SHARED_PREFIX = list(range(40, 72))  # two full blocks of 16
PROMPTS = [
    list(range(3, 10)),
    list(range(100, 116)),
    SHARED_PREFIX + list(range(200, 209)),
    SHARED_PREFIX + list(range(150, 153)),
]


def _save_tiny_llama(folder: Path) -> Path:
    torch.manual_seed(4321)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        # A wide init gives clear argmax winners, so equality does not hinge on rounding.
        initializer_range=0.3,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    LlamaForCausalLM(config).float().eval().save_pretrained(folder)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(["paged attention in blocks of sixteen tokens"], trainer=trainer)
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    ).save_pretrained(folder)
    return folder


def _transformers_greedy(folder: Path) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    outputs = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def test_triton_backend_matches_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sluicegate.engine import LLM, SamplingParams

    folder = _save_tiny_llama(tmp_path / "tiny-llama")
    expected = _transformers_greedy(folder)
    monkeypatch.setenv("SLUICEGATE_ATTENTION_BACKEND", "triton")
    llm = LLM(
        str(folder),
        block_size=16,
        num_kv_blocks=32,
        max_num_batched_tokens=24,
        enable_prefix_caching=True,
        device="cpu",
        dtype="float32",
    )
    assert llm.engine.runner.backend.name == "triton"
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)

    for _ in range(2):
        outputs = llm.generate(PROMPTS, greedy)
        assert [o.token_ids for o in outputs] == expected
    assert llm.stats()["prefix_cache_hits"] > 0

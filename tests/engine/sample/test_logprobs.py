"""Logprobs are the model's own distribution: they agree with an independent log-softmax of
transformers' logits on the same weights, and travel with each token's text and bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from sluicegate.engine import LLM, SamplingParams
from sluicegate.engine.sample.logprobs import wire_logprobs

PROMPT = [5, 17, 42, 9, 100, 33, 7, 250]


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logprobs_match_transformers(
    model_dirs: dict[str, Path], kind: str, temperature: float
) -> None:
    llm = LLM(str(model_dirs[kind]), num_kv_blocks=64)
    params = SamplingParams(
        max_tokens=10, temperature=temperature, seed=5, ignore_eos=True, logprobs=20
    )
    (out,) = llm.generate(PROMPT, params)
    model = AutoModelForCausalLM.from_pretrained(model_dirs[kind], dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = model(torch.tensor([PROMPT + out.token_ids])).logits[0].float()
    reference = torch.log_softmax(logits, dim=-1)[len(PROMPT) - 1 : -1]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for position, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = reference[position]
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(row[token].item(), abs=1e-4)
        values, indices = row.topk(20)
        assert [t for t, _ in entry.top] == indices.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(values.tolist(), abs=1e-4)


def test_logprobs_ignore_penalties_bias_and_grammar_masks(model_dirs: dict[str, Path]) -> None:
    llm = LLM(str(model_dirs["llama"]), num_kv_blocks=64)
    plain = SamplingParams(max_tokens=1, temperature=0, logprobs=3)
    biased = SamplingParams(max_tokens=1, temperature=0, logprobs=3, logit_bias={77: 100})
    (a,), (b,) = llm.generate(PROMPT, plain), llm.generate(PROMPT, biased)
    assert b.token_ids == [77]
    assert a.logprobs is not None and b.logprobs is not None
    assert a.logprobs[0].top == b.logprobs[0].top


def test_wire_entries_carry_text_and_exact_bytes(model_dirs: dict[str, Path]) -> None:
    llm = LLM(str(model_dirs["llama"]), num_kv_blocks=64)
    (out,) = llm.generate(
        PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    )
    assert out.logprobs is not None
    wire = wire_logprobs(out.logprobs, llm.tokenizer)
    joined = b"".join(bytes(entry.bytes) for entry in wire)
    assert joined.decode("utf-8", errors="replace") == llm.tokenizer.decode(out.token_ids)
    for entry, source in zip(wire, out.logprobs, strict=True):
        assert entry.logprob == source.logprob and len(entry.top) == 2
        assert entry.top[0].logprob == source.top[0][1]

"""Qwen3-style thinking: ``<think>`` text comes back apart from the answer, the template's
``enable_thinking`` switches it, and grammars and tool parsing apply to the answer only."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.protocol import Structured
from engine.request_options import RequestOptions

MESSAGES = [{"role": "user", "content": "Think first."}]
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2]}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def qwen3(model_dirs: dict[str, Path]) -> LLM:
    return LLM(str(model_dirs["qwen3"]), num_kv_blocks=128)


def end_think_id(llm: LLM) -> int:
    return llm.tokenizer.hf.convert_tokens_to_ids("</think>")


def test_thinking_text_goes_to_reasoning(qwen3: LLM) -> None:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    (out,) = qwen3.chat(MESSAGES, params)
    assert qwen3.tokenizer.decode(out.prompt_token_ids).endswith("<think>\n")
    (unparsed,) = qwen3.generate(out.prompt_token_ids, params)
    assert "</think>" not in unparsed.text
    assert out.reasoning_text == unparsed.text.lstrip("\n") and out.text == ""


def test_enable_thinking_false_answers_directly(qwen3: LLM) -> None:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    options = RequestOptions(chat_template_kwargs={"enable_thinking": False})
    (out,) = qwen3.chat(MESSAGES, params, options)
    assert qwen3.tokenizer.decode(out.prompt_token_ids).endswith("</think>\n\n")
    (unparsed,) = qwen3.generate(out.prompt_token_ids, params)
    assert out.reasoning_text == "" and out.text == unparsed.text


def test_the_answer_starts_after_the_thinking_block(qwen3: LLM) -> None:
    params = SamplingParams(
        max_tokens=4, temperature=0, ignore_eos=True, logit_bias={end_think_id(qwen3): 100}
    )
    (out,) = qwen3.chat(MESSAGES, params)
    assert out.reasoning_text == ""
    assert out.text == "</think>" * 3


def test_the_grammar_governs_only_the_answer(qwen3: LLM) -> None:
    """While thinking nothing is masked; once ``</think>`` is out the JSON must follow."""
    params = SamplingParams(max_tokens=80, temperature=0, logit_bias={end_think_id(qwen3): 100})
    options = RequestOptions(structured=Structured("json_schema", json_schema=json.dumps(SCHEMA)))
    (out,) = qwen3.chat(MESSAGES, params, options)
    assert out.token_ids[0] == end_think_id(qwen3), "the grammar did not mask the thinking part"
    assert out.reasoning_text == "" and out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), SCHEMA)

"""Qwen3-style thinking: ``<think>`` text comes back apart from the answer, the template's
``enable_thinking`` switches it, and grammars and tool parsing apply to the answer only."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import pytest

from sluicegate.engine import LLM, SamplingParams
from sluicegate.engine.protocol import Structured
from sluicegate.engine.serving.request_options import RequestOptions

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


@pytest.fixture(scope="module")
def qwen3_writes_its_own_think(
    model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> LLM:
    """Qwen3's original layout: the generation prompt stops at the assistant header and the
    model itself opens ``<think>`` (or answers at once)."""
    folder = tmp_path_factory.mktemp("qwen3-own-think")
    shutil.copytree(model_dirs["qwen3"], folder, dirs_exist_ok=True)
    template = folder / "chat_template.jinja"
    template.write_text(template.read_text().replace("{{- '<think>\\n' }}", ""))
    return LLM(str(folder), num_kv_blocks=128)


def test_a_grammar_still_lets_the_model_open_its_thinking(qwen3_writes_its_own_think: LLM) -> None:
    llm = qwen3_writes_its_own_think
    think = llm.tokenizer.hf.convert_tokens_to_ids("<think>")
    options = RequestOptions(structured=Structured("json_schema", json_schema=json.dumps(SCHEMA)))
    params = SamplingParams(max_tokens=6, temperature=0, logit_bias={think: 100})
    (thinking,) = llm.chat(MESSAGES, params, options)
    assert not llm.tokenizer.decode(thinking.prompt_token_ids).endswith("<think>\n")
    assert thinking.token_ids[0] == think, "the grammar kept the model from thinking"
    assert thinking.text == "" and thinking.reasoning_text != ""

    answer_params = SamplingParams(max_tokens=80, temperature=0, logit_bias={think: -100})
    (answer,) = llm.chat(MESSAGES, answer_params, options)
    assert answer.reasoning_text == "" and answer.finish_reason == "stop"
    jsonschema.validate(json.loads(answer.text), SCHEMA)

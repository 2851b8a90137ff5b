"""Structured output with xgrammar: every finished output parses and validates, grammars are
compiled once per schema, and unconstrained requests pay nothing."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from sluicegate.engine import LLM, AsyncEngine, SamplingParams
from sluicegate.engine.protocol import Structured
from sluicegate.engine.serving.request_options import RequestOptions

SHORT = {"type": "string", "maxLength": 6}
SCHEMAS = {
    "enums": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
        "required": ["color", "ok"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"name": SHORT, "admin": {"type": "boolean"}},
                "required": ["name", "admin"],
                "additionalProperties": False,
            },
            "level": {"enum": [1, 2, 3]},
        },
        "required": ["user", "level"],
        "additionalProperties": False,
    },
    "arrays": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
            "flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2},
        },
        "required": ["tags", "flags"],
        "additionalProperties": False,
    },
    "optional_fields": {
        "type": "object",
        "properties": {"id": {"enum": ["x", "y"]}, "note": SHORT},
        "required": ["id"],
        "additionalProperties": False,
    },
}
PROMPT = [{"role": "user", "content": "Reply in JSON."}]


@pytest.fixture(scope="module")
def llm(model_dirs: dict[str, Path]) -> LLM:
    return LLM(str(model_dirs["qwen2"]), num_kv_blocks=256)


def structured(kind: str, **fields: object) -> RequestOptions:
    return RequestOptions(structured=Structured(kind, **fields))  # type: ignore[arg-type]


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("seed", [None, 7, 8])
def test_json_schema_output_validates(llm: LLM, name: str, seed: int | None) -> None:
    schema = SCHEMAS[name]
    params = SamplingParams(max_tokens=120, temperature=0 if seed is None else 1.0, seed=seed)
    options = structured("json_schema", json_schema=json.dumps(schema), strict=True)
    (out,) = llm.chat(PROMPT, params, options)
    assert out.finish_reason == "stop", out.text
    value = json.loads(out.text)
    jsonschema.validate(value, schema)
    assert list(value) == [k for k in schema["properties"] if k in value], "schema key order"
    assert out.text == json.dumps(value, ensure_ascii=False), "no free whitespace"


def test_json_object_output_parses_unless_cut_by_length(llm: LLM) -> None:
    for seed in range(4):
        params = SamplingParams(max_tokens=60, temperature=1.0, seed=seed)
        (out,) = llm.chat(PROMPT, params, structured("json_object"))
        assert out.text.startswith("{")
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)
        else:
            assert out.finish_reason == "length"


def test_regex_choice_and_grammar(llm: LLM) -> None:
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=3)
    (regex,) = llm.generate("id:", params, structured("regex", regex=r"[0-9]{3}-[a-z]{2}"))
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", regex.text) and regex.finish_reason == "stop"
    (choice,) = llm.generate("pick:", params, structured("choice", choices=["yes", "no way"]))
    assert choice.text in ("yes", "no way") and choice.finish_reason == "stop"
    ebnf = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9]'
    (grammar,) = llm.generate("sum:", params, structured("grammar", grammar=ebnf))
    assert re.fullmatch(r"\([1-9](\+[1-9])*\)", grammar.text), grammar.text


def test_bad_grammars_are_invalid_requests_naming_the_field(llm: LLM) -> None:
    with pytest.raises(ValueError, match="guided_grammar"):
        llm.generate("x", SamplingParams(), structured("grammar", grammar="root ::= "))
    with pytest.raises(ValueError, match=r"response_format\.json_schema"):
        llm.generate("x", SamplingParams(), structured("json_schema", json_schema="{not json"))
    assert not llm.engine.has_unfinished()


def test_a_schema_is_compiled_once(llm: LLM) -> None:
    spec = llm.engine.grammar_spec(
        structured("json_schema", json_schema=json.dumps(SCHEMAS["enums"]))
    )
    assert spec is not None
    assert llm.engine.grammars.submit(spec) is llm.engine.grammars.submit(spec)


def test_grammars_never_take_a_token_the_text_leaves_out(llm: LLM) -> None:
    """Special tokens are left out of the answer's text (``skip_special_tokens``), so a grammar
    must not count one as characters: xgrammar read ``<pad>`` as five, and a string bound to
    1..12 characters came back empty or short (bench/structured_output.py saw
    ``"name": ""`` under ``minLength: 1``)."""
    import xgrammar

    tokenizer = llm.tokenizer
    vocab_size = llm.engine.model.config.vocab_size
    left_out = [
        i
        for i in tokenizer.hf.added_tokens_decoder
        if i < vocab_size and tokenizer.decode([i]) == ""
    ]
    assert len(left_out) >= 3, "the test tokenizer has special tokens"
    schema = {"type": "string", "minLength": 1, "maxLength": 12}
    spec = llm.engine.grammar_spec(structured("json_schema", json_schema=json.dumps(schema)))
    assert spec is not None
    matcher = xgrammar.GrammarMatcher(llm.engine.grammars.compile(spec))
    for token in tokenizer.hf.encode('"', add_special_tokens=False):
        assert matcher.accept_token(token)
    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask)

    def allowed(token: int) -> bool:
        return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)

    assert [t for t in left_out if allowed(t)] == []
    (letter,) = tokenizer.hf.encode("a", add_special_tokens=False)
    assert allowed(letter)


def test_unconstrained_requests_pay_nothing(model_dirs: dict[str, Path]) -> None:
    llm = LLM(str(model_dirs["llama"]), num_kv_blocks=64)
    core = llm.engine
    core.add_request("plain", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0))
    request = core.choices.by_seq["plain"]
    assert request.guide is None and request.output is None
    while core.has_unfinished():
        core.step()
    assert core.bitmask._bitmask is None, "no bitmask was ever allocated"


async def test_compiling_requests_wait_off_the_step_loop(model_dirs: dict[str, Path]) -> None:
    schema = json.dumps(SCHEMAS["nested"])
    params = SamplingParams(max_tokens=120, temperature=0)
    async with AsyncEngine(model_dirs["qwen2"], num_kv_blocks=256) as engine:
        streams = [
            engine.add_request(
                f"s{i}",
                messages=PROMPT,
                params=params,
                options=structured("json_schema", json_schema=schema),
            )
            for i in range(3)
        ]
        plain = engine.add_request("p", prompt_token_ids=[5, 6, 7], params=params)
        outputs = [[d async for d in s] for s in [*streams, plain]]
    texts = ["".join(d.text for d in deltas) for deltas in outputs]
    for text in texts[:3]:
        jsonschema.validate(json.loads(text), SCHEMAS["nested"])
    assert len(set(texts[:3])) == 1
    assert outputs[3][-1].finish_reason in ("stop", "length")


async def test_every_choice_of_n_follows_the_schema(model_dirs: dict[str, Path]) -> None:
    schema = SCHEMAS["arrays"]
    options = RequestOptions(
        n=3, structured=Structured("json_schema", json_schema=json.dumps(schema))
    )
    params = SamplingParams(max_tokens=120, temperature=1.0, seed=11)
    async with AsyncEngine(model_dirs["qwen2"], num_kv_blocks=256) as engine:
        deltas = [
            d
            async for d in engine.add_request("n3", messages=PROMPT, params=params, options=options)
        ]
    texts = ["".join(d.text for d in deltas if d.index == i) for i in range(3)]
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    assert len(set(texts)) > 1, "choices sample independently"
    assert {d.finish_reason for d in deltas if d.finish_reason} == {"stop"}

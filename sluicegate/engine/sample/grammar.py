"""Grammars for constrained decoding, compiled with xgrammar once per spec and off the step loop.

A ``GrammarSpec`` is the canonical text of what to enforce; its hash keys a cache of compile
futures, so a schema many requests share is compiled once, and a request whose grammar is still
compiling waits without holding up the step loop. JSON is compiled without free whitespace: a
weak model otherwise pads its JSON with newlines until it runs out of tokens.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sluicegate.engine.protocol import Structured, Tool
from sluicegate.engine.serving.request_options import RequestOptions

if TYPE_CHECKING:
    import xgrammar

_CACHE_SIZE = 256


@dataclass(frozen=True)
class GrammarSpec:
    kind: str
    """json_object, json_schema, regex, choice, grammar, or tool_call."""
    source: str

    @property
    def key(self) -> str:
        return hashlib.sha256(f"{self.kind}\0{self.source}".encode()).hexdigest()


def request_grammar_spec(options: RequestOptions, tool_parser: str | None) -> GrammarSpec | None:
    """What a request's output must match, or None; raises ValueError for a request the model
    cannot honour (tools without a known call format)."""
    if options.uses_tools and tool_parser is None:
        raise ValueError(
            "tools: this model's chat template has no known tool-call format; "
            "start the engine with --tool-parser"
        )
    if options.forces_tool_call:
        # This turn's output is a call; response_format governs answers, not calls.
        assert tool_parser is not None
        return tool_call_spec(tool_parser, options.forced_tools())
    if options.structured is not None:
        answer = structured_spec(options.structured)
        if options.has_strict_tools:
            assert tool_parser is not None
            return answer_or_call_spec(answer, tool_parser, options.tools or [])
        return answer
    if options.has_strict_tools:
        assert tool_parser is not None
        return strict_tools_spec(tool_parser, options.tools or [])
    return None


def structured_spec(structured: Structured) -> GrammarSpec:
    kind = structured.kind
    if kind == "json_object":
        return GrammarSpec(kind, "")
    if kind == "json_schema":
        if not structured.json_schema:
            raise ValueError("response_format.json_schema.schema is missing")
        try:
            schema = json.loads(structured.json_schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"response_format.json_schema.schema is not JSON: {exc}") from None
        # Key order is kept: properties come out in the schema's order, as clients expect.
        return GrammarSpec(kind, json.dumps(schema))
    if kind == "regex":
        if not structured.regex:
            raise ValueError("guided_regex is empty")
        return GrammarSpec(kind, structured.regex)
    if kind == "choice":
        if not structured.choices:
            raise ValueError("guided_choice is empty")
        return GrammarSpec(kind, json.dumps(structured.choices))
    if kind == "grammar":
        if not structured.grammar:
            raise ValueError("guided_grammar is empty")
        return GrammarSpec(kind, structured.grammar)
    raise ValueError(f"unknown structured output kind {kind!r}")


def tool_call_spec(parser: str, tools: list[Tool]) -> GrammarSpec:
    """One call to one of ``tools`` in ``parser``'s markup, arguments matching its schema."""
    described = [{"name": t.name, "parameters": t.parameters or {"type": "object"}} for t in tools]
    return GrammarSpec("tool_call", json.dumps({"parser": parser, "tools": described}))


def strict_tools_spec(parser: str, tools: list[Tool]) -> GrammarSpec:
    """Free text, but any call the model starts (``tool_choice`` auto) must name one of
    ``tools`` and, for a tool marked ``strict``, match its schema."""
    described = [
        {
            "name": t.name,
            "parameters": (t.parameters or {"type": "object"})
            if t.strict
            else {"type": "object", "additionalProperties": True},
        }
        for t in tools
    ]
    return GrammarSpec("tool_auto", json.dumps({"parser": parser, "tools": described}))


def answer_or_call_spec(answer: GrammarSpec, parser: str, tools: list[Tool]) -> GrammarSpec:
    """Structured output that may also be a call to one of ``tools`` (``tool_choice`` auto
    with strict tools and a ``response_format``): either the answer the format asks for or one
    call whose arguments match its tool's schema (a strict tool's; any object otherwise)."""
    call = json.loads(strict_tools_spec(parser, tools).source)
    source = {"answer_kind": answer.kind, "answer": answer.source, "call": call}
    return GrammarSpec("answer_or_call", json.dumps(source))


def _call_schema(parser: str, tools: list[dict[str, Any]]) -> dict[str, Any]:
    args_key = "parameters" if parser == "llama3_json" else "arguments"
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": tool["name"]}, args_key: tool["parameters"]},
            "required": ["name", args_key],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


class GrammarCompiler:
    """xgrammar's compiler for one tokenizer, behind a small thread pool and a cache."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._hf_tokenizer = hf_tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._compiler: xgrammar.GrammarCompiler | None = None
        self._tokenizer_info: xgrammar.TokenizerInfo | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Future[xgrammar.CompiledGrammar]] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")

    @property
    def tokenizer_info(self) -> xgrammar.TokenizerInfo:
        with self._lock:
            if self._tokenizer_info is None:
                import xgrammar

                info = xgrammar.TokenizerInfo.from_huggingface(
                    self._hf_tokenizer,
                    vocab_size=self._vocab_size,
                    stop_token_ids=self._stop_token_ids,
                )
                self._tokenizer_info = _without_left_out_tokens(info, self._hf_tokenizer)
            return self._tokenizer_info

    def submit(self, spec: GrammarSpec) -> Future[xgrammar.CompiledGrammar]:
        """The compiled grammar of ``spec``, from the cache or compiled on the pool."""
        with self._lock:
            future = self._cache.get(spec.key)
            if future is not None:
                self._cache.move_to_end(spec.key)
                return future
            future = self._pool.submit(self._compile, spec)
            self._cache[spec.key] = future
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        future.add_done_callback(lambda f: self._forget_failure(spec.key, f))
        return future

    def background(self, task: Callable[[], object]) -> None:
        """Run ``task`` on the compile threads (start-up work no request should wait for)."""
        self._pool.submit(task)

    def compile(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        return self.submit(spec).result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _forget_failure(self, key: str, future: Future[Any]) -> None:
        if future.exception() is not None:
            with self._lock:
                if self._cache.get(key) is future:
                    del self._cache[key]

    def _xgrammar_compiler(self) -> xgrammar.GrammarCompiler:
        import xgrammar

        info = self.tokenizer_info
        with self._lock:
            if self._compiler is None:
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def _compile(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        import xgrammar

        compiler = self._xgrammar_compiler()
        try:
            return compiler.compile_grammar(_grammar(spec))
        except (RuntimeError, ValueError, xgrammar.InvalidJSONError) as exc:
            raise ValueError(f"{_field_of(spec.kind)} does not compile: {exc}") from None


def _without_left_out_tokens(info: xgrammar.TokenizerInfo, hf: Any) -> xgrammar.TokenizerInfo:
    """``info`` with the special tokens the detokenizer leaves out of the text (it decodes with
    ``skip_special_tokens``) as empty, which xgrammar never lets a grammar take. It reads them
    as their literal text (``<|pad|>``), so a string bound to 1..8 characters could take one
    and come back empty; stop tokens stay as they are (a grammar ends on them)."""
    import xgrammar

    stop = set(info.stop_token_ids)
    vocab = list(info.decoded_vocab)
    left_out = [
        token
        for token in hf.added_tokens_decoder
        if token not in stop
        and token < len(vocab)
        and vocab[token]
        and hf.decode([token], skip_special_tokens=True) == ""
    ]
    if not left_out:
        return info
    for token in left_out:
        vocab[token] = b""
    return xgrammar.TokenizerInfo(
        vocab,
        xgrammar.VocabType.RAW,
        vocab_size=info.vocab_size,
        stop_token_ids=info.stop_token_ids,
        add_prefix_space=info.add_prefix_space,
    )


def _grammar(spec: GrammarSpec) -> Any:
    import xgrammar

    if spec.kind == "json_object":
        return xgrammar.Grammar.from_json_schema(
            '{"type": "object"}', any_whitespace=False, strict_mode=False
        )
    if spec.kind == "json_schema":
        return _json_schema_grammar(json.loads(spec.source))
    if spec.kind == "regex":
        return xgrammar.Grammar.from_regex(spec.source)
    if spec.kind == "choice":
        choices = " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(spec.source))
        return xgrammar.Grammar.from_ebnf(f"root ::= {choices}")
    if spec.kind == "grammar":
        return xgrammar.Grammar.from_ebnf(spec.source)
    if spec.kind == "tool_call":
        return _tool_call_grammar(json.loads(spec.source))
    if spec.kind == "tool_auto":
        return _strict_tools_grammar(json.loads(spec.source))
    if spec.kind == "answer_or_call":
        parts = json.loads(spec.source)
        answer = _grammar(GrammarSpec(parts["answer_kind"], parts["answer"]))
        return xgrammar.Grammar.union(answer, _tool_call_grammar(parts["call"]))
    raise ValueError(f"unknown grammar kind {spec.kind!r}")


# xgrammar 0.2.9 writes length-bounded strings (minLength/maxLength) with this character
# class, which lets raw control characters through: the output would not parse as JSON.
_LOOSE_STRING_CHAR = '[^\\"\\\\\\r\\n]'
# The replacement also keeps out surrogates (U+D800-DFFF): xgrammar accepts their 3-byte
# encodings, which are not UTF-8, so the text decoded to three U+FFFD per surrogate and
# broke maxLength (seeded sampling drew them for some seeds).
_JSON_STRING_CHAR = '[^\\0-\\x1f\\"\\\\\\uD800-\\uDFFF]'


def _json_schema_grammar(schema: dict[str, Any]) -> Any:
    import xgrammar

    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
    text = str(grammar)
    if _LOOSE_STRING_CHAR not in text:
        return grammar
    return xgrammar.Grammar.from_ebnf(text.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR))


def _tool_call_grammar(described: dict[str, Any]) -> Any:
    import xgrammar

    parser = described["parser"]
    call = _json_schema_grammar(_call_schema(parser, described["tools"]))
    if parser == "hermes":
        return xgrammar.Grammar.concat(
            xgrammar.Grammar.from_ebnf('root ::= "<tool_call>\\n"'),
            call,
            xgrammar.Grammar.from_ebnf('root ::= "\\n</tool_call>"'),
        )
    return call


def _strict_tools_grammar(described: dict[str, Any]) -> Any:
    """xgrammar structural tags: text is free until a call's opening markup (the trigger),
    then the call must be complete and well-formed."""
    import xgrammar

    if described["parser"] == "hermes":
        trigger, args_key, opening, closing = (
            "<tool_call>",
            "arguments",
            "<tool_call>\n",
            "}\n</tool_call>",
        )
    else:
        trigger, args_key, opening, closing = '{"name": ', "parameters", "", "}"
    tags = [
        xgrammar.StructuralTagItem(
            begin=f'{opening}{{"name": {json.dumps(tool["name"])}, "{args_key}": ',
            schema=json.dumps(tool["parameters"]),
            end=closing,
        )
        for tool in described["tools"]
    ]
    grammar = xgrammar.Grammar.from_structural_tag(tags, [trigger])
    # Structural tags always allow free whitespace in the JSON; pin it to json.dumps' layout.
    text = _tight_json(str(grammar)).replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR)
    return xgrammar.Grammar.from_ebnf(text)


_FREE_SPACE = "[ \\n\\r\\t]*"


def _tight_json(ebnf: str) -> str:
    for separator in ('":"', '","'):
        spaced = f'"{separator[1]} "'
        ebnf = ebnf.replace(f"{_FREE_SPACE} {separator} {_FREE_SPACE}", spaced)
    return ebnf.replace(f"{_FREE_SPACE} ", "").replace(f" {_FREE_SPACE}", "")


def _field_of(kind: str) -> str:
    return {
        "json_object": "response_format",
        "json_schema": "response_format.json_schema",
        "regex": "guided_regex",
        "choice": "guided_choice",
        "grammar": "guided_grammar",
        "tool_call": "tools",
        "tool_auto": "tools",
        "answer_or_call": "response_format",
    }.get(kind, kind)

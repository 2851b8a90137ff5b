"""Chat templates rendered without transformers, exactly as its ``apply_chat_template`` renders
them: the same sandboxed Jinja environment, filters and globals, the same message clean-up.

Torch-free on purpose: a gateway renders a request's prompt with this to compute the block
hashes a worker's prefix cache would give it (docs/kv-events.md). A test holds the output
equal to transformers' for the test models' templates.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, ClassVar

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks;
    rendering keeps its body as is."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


class _TemplateDict:
    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace without underscore-prefixed attributes (as transformers forbids)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r}")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format_string: str) -> str:
    return datetime.now().strftime(format_string)


@lru_cache(maxsize=16)
def _compiled(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env.from_string(template)


def pick_template(
    templates: str | dict[str, str] | None, tools: list[dict[str, Any]] | None
) -> str | None:
    """The template a request uses: a tokenizer with several names ``tool_use`` for requests
    with tools and ``default`` otherwise."""
    if isinstance(templates, dict):
        if tools is not None and "tool_use" in templates:
            return templates["tool_use"]
        return templates.get("default")
    return templates


def _plain(message: dict[str, Any]) -> dict[str, Any]:
    """None-valued keys dropped (templates handle a missing key, not a None), reasoning
    copied under the names templates read it by."""
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def render_chat(
    template: str,
    messages: list[dict[str, Any]],
    special_tokens: dict[str, Any],
    tools: list[dict[str, Any]] | None = None,
    **template_kwargs: Any,
) -> str:
    """The prompt text of ``messages`` with the generation prompt added."""
    return _compiled(template).render(
        messages=[_plain(m) for m in messages],
        tools=tools,
        documents=None,
        add_generation_prompt=True,
        **{**special_tokens, **template_kwargs},
    )

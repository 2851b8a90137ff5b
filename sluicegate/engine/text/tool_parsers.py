"""Incremental tool-call parsers, one per model family's call markup.

A parser eats the answer text as it streams and returns what may go out now: plain content
(never any call markup) and OpenAI-style call fragments (first ``id`` and ``name``, then
pieces of the arguments JSON text). Text that might still turn into markup is held back until
it is decided. The arguments are streamed as the model wrote them, so the pieces of one call
always concatenate to its complete arguments text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from sluicegate.engine.protocol import ToolCallDelta

_NAME_THEN_ARGS = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(\w+)"\s*:\s*')


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedOutput:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class _CallBody:
    """The JSON object of one call, as it streams: ``{"name": ..., "<args key>": ...}``."""

    def __init__(self, index: int, args_keys: tuple[str, ...]) -> None:
        self.index = index
        self.args_keys = args_keys
        self.text = ""
        self.announced = False
        self.args_start = -1
        self.args_sent = 0

    def feed(self, text: str) -> list[ToolCallDelta]:
        """Stream what is certain: the name once known, then the arguments, less a trailing
        ``}`` and whitespace (which may be the call object's own end)."""
        self.text += text
        out: list[ToolCallDelta] = []
        if not self.announced:
            match = _NAME_THEN_ARGS.match(self.text)
            # Wait for the first character of the arguments, so the whitespace before them
            # is never counted as part of them, however the text was split.
            if match is None or match.group(2) not in self.args_keys:
                return out
            if match.end() == len(self.text):
                return out
            self.announced = True
            self.args_start = match.end()
            out.append(ToolCallDelta(self.index, id=new_call_id(), name=json.loads(match.group(1))))
        safe_end = len(self.text.rstrip())
        if self.text[:safe_end].endswith("}"):
            safe_end -= 1
        if safe_end > self.args_start + self.args_sent:
            piece = self.text[self.args_start + self.args_sent : safe_end]
            self.args_sent += len(piece)
            out.append(ToolCallDelta(self.index, arguments=piece))
        return out

    def close(self) -> list[ToolCallDelta] | None:
        """The call's remaining fragments, or None if the body is not a call at all."""
        try:
            call = json.loads(self.text)
        except json.JSONDecodeError:
            call = None
        if self.announced:
            tail = self.text.rstrip()
            tail = tail[:-1] if tail.endswith("}") else tail
            rest = tail[self.args_start + self.args_sent :].rstrip()
            return [ToolCallDelta(self.index, arguments=rest)] if rest else []
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        args = next((call[k] for k in self.args_keys if k in call), {})
        return [
            ToolCallDelta(self.index, id=new_call_id(), name=call["name"]),
            ToolCallDelta(self.index, arguments=json.dumps(args, ensure_ascii=False)),
        ]


class ToolCallParser:
    """Common state: calls found so far and content held back."""

    name = ""
    args_keys: tuple[str, ...] = ("arguments",)

    def __init__(self) -> None:
        self.num_calls = 0

    def feed(self, text: str) -> ParsedOutput:
        raise NotImplementedError

    def finish(self) -> ParsedOutput:
        raise NotImplementedError


class HermesToolParser(ToolCallParser):
    """``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (Hermes, Qwen2.5, Qwen3)."""

    name = "hermes"
    start = "<tool_call>"
    end = "</tool_call>"

    def __init__(self) -> None:
        super().__init__()
        self._pending = ""
        self._body: _CallBody | None = None
        self._after_call = False

    def feed(self, text: str) -> ParsedOutput:
        out = ParsedOutput()
        self._pending += text
        while self._pending:
            if self._body is None and self._after_call:
                # The newline templates put between calls is markup, not content.
                self._pending = self._pending.lstrip("\n")
                if not self._pending:
                    break
                self._after_call = False
            if self._body is None:
                at = self._pending.find(self.start)
                if at < 0:
                    keep = _partial_suffix(self._pending, self.start)
                    out.content += self._pending[: len(self._pending) - keep]
                    self._pending = self._pending[len(self._pending) - keep :]
                    break
                out.content += self._pending[:at]
                self._pending = self._pending[at + len(self.start) :]
                self._body = _CallBody(self.num_calls, self.args_keys)
                continue
            at = self._pending.find(self.end)
            if at < 0:
                keep = _partial_suffix(self._pending, self.end)
                out.tool_calls += self._body.feed(self._pending[: len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep :]
                break
            if _in_json_string(self._body.text + self._pending[:at]):
                # The end tag inside a string argument is text, not the end of the call.
                out.tool_calls += self._body.feed(self._pending[: at + len(self.end)])
                self._pending = self._pending[at + len(self.end) :]
                continue
            out.tool_calls += self._body.feed(self._pending[:at])
            out.tool_calls += self._close_body()
            self._pending = self._pending[at + len(self.end) :]
            self._after_call = True
        return out

    def _close_body(self) -> list[ToolCallDelta]:
        assert self._body is not None
        fragments = self._body.close()
        self._body = None
        if fragments is None:
            return []
        self.num_calls += 1
        return fragments

    def finish(self) -> ParsedOutput:
        out = ParsedOutput()
        if self._body is not None:
            # Cut short (max_tokens): the call goes out as it stands, less any partial end tag.
            keep = _partial_suffix(self._pending, self.end)
            out.tool_calls += self._body.feed(self._pending[: len(self._pending) - keep])
            out.tool_calls += self._close_body()
        else:
            out.content = self._pending
        self._pending = ""
        return out


class Llama3JsonToolParser(ToolCallParser):
    """Llama 3.1/3.2: the whole answer is ``{"name": ..., "parameters": ...}`` (optionally after
    ``<|python_tag|>``, several calls separated by ``;``); any other answer is content."""

    name = "llama3_json"
    args_keys = ("parameters", "arguments")
    python_tag = "<|python_tag|>"

    def __init__(self) -> None:
        super().__init__()
        self._head = ""
        self._mode: str | None = None
        self._body: _CallBody | None = None

    def feed(self, text: str) -> ParsedOutput:
        out = ParsedOutput()
        if self._mode is None:
            self._head += text
            stripped = self._head.lstrip()
            if stripped.startswith(self.python_tag):
                stripped = stripped[len(self.python_tag) :].lstrip()
            elif self.python_tag.startswith(stripped):
                return out
            if not stripped:
                return out
            self._mode = "calls" if stripped.startswith("{") else "content"
            text, self._head = (stripped if self._mode == "calls" else self._head), ""
        if self._mode == "content":
            out.content = text
            return out
        for piece in re.split(r"(;)", text):
            if piece == ";" and self._body is not None and _balanced(self._body.text):
                out.tool_calls += self._close_body()
                continue
            if self._body is None:
                if not piece.strip():
                    continue
                self._body = _CallBody(self.num_calls, self.args_keys)
            out.tool_calls += self._body.feed(piece)
        return out

    def _close_body(self) -> list[ToolCallDelta]:
        assert self._body is not None
        fragments = self._body.close()
        self._body = None
        if fragments is None:
            return []
        self.num_calls += 1
        return fragments

    def finish(self) -> ParsedOutput:
        out = ParsedOutput()
        if self._mode is None:
            out.content = self._head
        elif self._body is not None:
            body, self._body = self._body, None
            fragments = body.close()
            if fragments is None:
                # Not a call after all (an answer that merely starts with "{").
                if self.num_calls == 0:
                    out.content = body.text
            else:
                self.num_calls += 1
                out.tool_calls += fragments
        return out


def _balanced(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def _in_json_string(text: str) -> bool:
    """Whether ``text`` (the start of a JSON value) ends inside a string literal."""
    inside = escaped = False
    for char in text:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = inside
        elif char == '"':
            inside = not inside
    return inside


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that begins ``marker``."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


TOOL_PARSERS: dict[str, type[ToolCallParser]] = {
    HermesToolParser.name: HermesToolParser,
    Llama3JsonToolParser.name: Llama3JsonToolParser,
}


def make_tool_parser(name: str) -> ToolCallParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(
            f"unknown tool parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}"
        ) from None


def detect_tool_parser(chat_template: str | None) -> str | None:
    """The parser a checkpoint's chat template implies, or None for a template without tools."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return HermesToolParser.name
    if "<|python_tag|>" in chat_template or '"parameters"' in chat_template:
        return Llama3JsonToolParser.name
    return None

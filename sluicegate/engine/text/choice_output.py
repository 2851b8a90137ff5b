"""Splits one choice's streamed text into answer content, reasoning text and tool calls."""

from __future__ import annotations

from dataclasses import dataclass, field

from sluicegate.engine.protocol import ToolCallDelta
from sluicegate.engine.text.reasoning import ReasoningSplitter
from sluicegate.engine.text.tool_parsers import ToolCallParser


@dataclass
class ChoiceText:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ChoiceOutput:
    """Reasoning first (``<think>`` never reaches the answer), then tool-call parsing of the
    answer. A choice with neither is a pass-through."""

    def __init__(
        self,
        reasoning: ReasoningSplitter | None,
        tool_parser: ToolCallParser | None,
        parallel_tool_calls: bool = True,
    ) -> None:
        self.reasoning = reasoning
        self.tool_parser = tool_parser
        self.parallel_tool_calls = parallel_tool_calls

    @property
    def num_tool_calls(self) -> int:
        return self.tool_parser.num_calls if self.tool_parser is not None else 0

    @property
    def in_answer(self) -> bool:
        """Whether the text so far has left the reasoning block (grammars apply from here)."""
        return self.reasoning is None or self.reasoning.in_answer

    def feed(self, text: str) -> ChoiceText:
        return self._route(*self.reasoning.feed(text) if self.reasoning else ("", text), False)

    def finish(self) -> ChoiceText:
        reasoning, answer = self.reasoning.finish() if self.reasoning else ("", "")
        return self._route(reasoning, answer, True)

    def _route(self, reasoning: str, answer: str, final: bool) -> ChoiceText:
        out = ChoiceText(reasoning=reasoning)
        if self.tool_parser is None:
            out.content = answer
            return out
        parsed = self.tool_parser.feed(answer) if answer else None
        if parsed is not None:
            out.content += parsed.content
            out.tool_calls += parsed.tool_calls
        if final:
            rest = self.tool_parser.finish()
            out.content += rest.content
            out.tool_calls += rest.tool_calls
        if not self.parallel_tool_calls:
            # parallel_tool_calls=false: one call at most; any further ones are not made.
            out.tool_calls = [f for f in out.tool_calls if f.index == 0]
        return out

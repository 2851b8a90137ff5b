"""Separates a thinking model's ``<think>...</think>`` text from its answer, as it streams.

A reply is in reasoning from the start when the prompt itself opened the block (templates that
end the generation prompt with ``<think>``), or when the output begins with ``<think>``;
everything after ``</think>`` is the answer. Tool-call and JSON parsing see only the answer.
"""

from __future__ import annotations

START = "<think>"
END = "</think>"


def template_has_reasoning(chat_template: str | None) -> bool:
    return bool(chat_template) and END in (chat_template or "")


def prompt_opens_reasoning(prompt_tail: str) -> bool:
    """Whether the prompt ends inside an open thinking block."""
    tail = prompt_tail.rstrip()
    return tail.endswith(START)


class ReasoningSplitter:
    def __init__(self, in_reasoning: bool) -> None:
        self._state = "reasoning" if in_reasoning else "undecided"
        self._pending = ""
        self._strip_next = in_reasoning

    @property
    def decided(self) -> bool:
        """False until the output shows whether it opens with a thinking block."""
        return self._state != "undecided"

    @property
    def in_answer(self) -> bool:
        """Past the thinking block, or not (yet) in one: a grammar governs the text from here."""
        return self._state != "reasoning"

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) text that may go out now."""
        self._pending += text
        reasoning = answer = ""
        if self._state == "undecided":
            head = self._pending.lstrip()
            if head.startswith(START):
                self._pending = head[len(START) :]
                self._state = "reasoning"
                self._strip_next = True
            elif START.startswith(head):
                return "", ""
            else:
                self._state = "answer"
        if self._state == "reasoning":
            if self._strip_next:
                self._pending = self._pending.lstrip("\n")
                if not self._pending:
                    return "", ""
                self._strip_next = False
            at = self._pending.find(END)
            if at < 0:
                keep = _partial_suffix(self._pending, END)
                reasoning = self._pending[: len(self._pending) - keep]
                self._pending = self._pending[len(self._pending) - keep :]
                return reasoning, ""
            reasoning = self._pending[:at].rstrip("\n")
            self._pending = self._pending[at + len(END) :]
            self._state = "answer_start"
        if self._state == "answer_start":
            self._pending = self._pending.lstrip("\n")
            if not self._pending:
                return reasoning, ""
            self._state = "answer"
        answer, self._pending = self._pending, ""
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        rest, self._pending = self._pending, ""
        if self._state == "reasoning":
            return rest, ""
        return "", rest


def _partial_suffix(text: str, marker: str) -> int:
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0

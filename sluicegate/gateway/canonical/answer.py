"""The canonical answer: token usage, a stream's ``Chunk`` of per-choice deltas, and a whole
``Response`` of ``Choice``s."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from sluicegate.gateway.canonical.request import Message, Role, TextPart
from sluicegate.gateway.schemas.bounds import MAX_USAGE_TOKENS


class Usage(msgspec.Struct, omit_defaults=True):
    """Token counts, as an upstream reported them or the gateway counted them. Every count is
    clamped into ``[0, MAX_USAGE_TOKENS]`` when the usage is made (or decoded): an upstream's
    negative or absurd count never reaches a budget counter, a metric or a usage row."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    """Prompt tokens served from a cache (part of ``prompt_tokens``)."""
    reasoning_tokens: int = 0
    """Completion tokens spent thinking (part of ``completion_tokens``)."""
    cache_creation_tokens: int = 0
    """Prompt tokens written to a provider's prompt cache (part of ``prompt_tokens``)."""

    def __post_init__(self) -> None:
        if not (
            0 <= self.prompt_tokens <= MAX_USAGE_TOKENS
            and 0 <= self.completion_tokens <= MAX_USAGE_TOKENS
            and 0 <= self.cached_tokens <= MAX_USAGE_TOKENS
            and 0 <= self.reasoning_tokens <= MAX_USAGE_TOKENS
            and 0 <= self.cache_creation_tokens <= MAX_USAGE_TOKENS
        ):
            for name in _USAGE_COUNTS:
                value = min(max(int(getattr(self, name)), 0), MAX_USAGE_TOKENS)
                setattr(self, name, value)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


_USAGE_COUNTS = (
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "reasoning_tokens",
    "cache_creation_tokens",
)


FinishReason = str
"""``stop``, ``length``, ``tool_calls``, ``content_filter``, ``abort`` (the engine cancelled
it), or whatever else an upstream reported, passed on as is."""


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top: list[TopLogprob] = msgspec.field(default_factory=list)


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    """A streamed piece of a tool call: its first piece has ``id`` and ``name`` (the call
    starts), later pieces carry fragments of ``arguments``."""

    index: int
    """Position of the call within its choice."""
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class ChoiceDelta(msgspec.Struct, omit_defaults=True):
    """The stream events of one choice within one chunk: answer text, reasoning text, tool-call
    starts and argument fragments, the tokens' logprobs, and at its end the finish reason."""

    index: int = 0
    text: str = ""
    reasoning: str = ""
    refusal: str = ""
    tool_calls: list[ToolCallDelta] | None = None
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    stop_sequence: str | None = None
    """The client's stop sequence that ended the choice, when the backend says which."""
    reasoning_signature: str = ""
    """The backend's signature of the reasoning since the last signature: it ends that block
    of thinking (the next reasoning starts another)."""
    reasoning_redacted: str = ""
    """A whole block of encrypted thinking (``ReasoningPiece.redacted``)."""

    def has_output(self) -> bool:
        return bool(
            self.text
            or self.reasoning
            or self.refusal
            or self.tool_calls
            or self.reasoning_redacted
        )

    def is_answer(self) -> bool:
        """Output, the tokens' logprobs, a reasoning signature or the finish: something of this
        deployment's own answer (what precedes it, a role, could come from any deployment)."""
        return bool(
            self.has_output()
            or self.logprobs
            or self.reasoning_signature
            or self.finish_reason is not None
        )


@dataclass(slots=True)
class Chunk:
    """One step of a provider's stream. The last chunk of a stream has every choice's
    ``finish_reason`` behind it, and ``usage`` when the provider reports it."""

    choices: list[ChoiceDelta] = field(default_factory=list)
    usage: Usage | None = None
    num_tokens: int = 0
    """Completion tokens this chunk carries, when the provider knows them (0 = unknown)."""
    prompt_tokens: int = 0
    """The prompt's real token count once known (0 = unknown), so a request cut short is
    billed its real prompt rather than the admission estimate."""
    raw: dict[str, Any] | None = None
    """The upstream's own chunk, when it speaks OpenAI's chat/completions wire format."""

    def has_output(self) -> bool:
        return any(choice.has_output() for choice in self.choices)

    def is_answer(self) -> bool:
        """Whether the answer has begun with this chunk: output, logprobs, a finish or usage.
        The chunks before it (Anthropic's ``message_start``, OpenAI's role-only chunk) carry
        no answer, so a failure after them may still move to another deployment."""
        return self.usage is not None or any(choice.is_answer() for choice in self.choices)

    def finish_reason(self) -> FinishReason | None:
        for choice in self.choices:
            if choice.finish_reason is not None:
                return choice.finish_reason
        return None


class Choice(msgspec.Struct, omit_defaults=True):
    """One whole answer: ``message`` holds its text and tool calls, ``message.reasoning`` its
    thinking."""

    index: int
    message: Message
    finish_reason: FinishReason
    refusal: str | None = None
    logprobs: list[TokenLogprob] | None = None
    stop_sequence: str | None = None


@dataclass(slots=True)
class Response:
    """A whole (non-streamed) answer."""

    choices: list[Choice]
    usage: Usage | None = None
    num_tokens: int = 0
    """Completion tokens, when known without ``usage``."""
    raw: dict[str, Any] | None = None
    """The upstream's own body, when it speaks OpenAI's wire format."""

    def text(self) -> str:
        return self.choices[0].message.text() if self.choices else ""

    def finish_reason(self) -> FinishReason | None:
        return self.choices[0].finish_reason if self.choices else None


def text_message(role: Role, text: str, name: str | None = None) -> Message:
    return Message(role=role, parts=[TextPart(text)], name=name)

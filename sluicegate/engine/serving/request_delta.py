"""What the engine hands back per step and request: ``RequestDelta`` and its timings."""

from __future__ import annotations

from dataclasses import dataclass, field

from sluicegate.engine.protocol import ToolCallDelta, Usage
from sluicegate.engine.sample.output import TokenLogprobs
from sluicegate.engine.text.choice_output import ChoiceText


@dataclass(frozen=True, slots=True)
class RequestTimings:
    """A request's phases in ``time.monotonic()`` seconds; None for a phase never reached."""

    arrival: float
    first_scheduled: float | None
    first_token: float | None
    finished: float
    num_preemptions: int


@dataclass
class RequestDelta:
    """What one step added to one request. The last delta has ``finish_reason``, ``usage``
    and ``timings``; every delta names the prompt's length, so a request cut short (client
    gone, worker draining) is billed its real prompt tokens rather than an estimate."""

    request_id: str
    num_prompt_tokens: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    """This choice ended ("stop", "length", "abort" or "tool_calls")."""
    usage: Usage | None = None
    """On a choice's last delta: the prompt once plus every choice's tokens so far."""
    timings: RequestTimings | None = None
    index: int = 0
    reasoning_text: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    done: bool = False
    """The request's last delta: every choice has finished."""
    stop_sequence: str | None = None
    """The client's stop string that ended this choice."""


def fill_text(delta: RequestDelta, text: ChoiceText) -> None:
    delta.text = text.content
    delta.reasoning_text = text.reasoning
    delta.tool_calls = text.tool_calls

"""OpenAI's chat answer objects: ``chat.completion`` and ``chat.completion.chunk``.

Field order and ``null``s follow OpenAI's objects; fields OpenAI sends only when they apply
(``tool_calls``, ``reasoning_content``) are left out otherwise.
"""

from __future__ import annotations

import msgspec

from sluicegate.gateway import canonical
from sluicegate.gateway.schemas.wire import UsageOut


class TopLogprobOut(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprobOut]


class ChoiceLogprobs(msgspec.Struct):
    content: list[TokenLogprobOut] | None
    refusal: None = None


def logprobs_out(logprobs: list[canonical.TokenLogprob] | None) -> ChoiceLogprobs | None:
    if logprobs is None:
        return None
    return ChoiceLogprobs(
        [
            TokenLogprobOut(
                lp.token,
                lp.logprob,
                lp.bytes,
                [TopLogprobOut(top.token, top.logprob, top.bytes) for top in lp.top],
            )
            for lp in logprobs
        ]
    )


class FunctionOut(msgspec.Struct):
    name: str
    arguments: str


class ToolCallOut(msgspec.Struct):
    id: str
    function: FunctionOut
    type: str = "function"


class AssistantMessage(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | None
    refusal: str | None
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: str


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageOut
    object: str = "chat.completion"
    system_fingerprint: None = None


class FunctionChunk(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallChunk(msgspec.Struct, omit_defaults=True):
    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionChunk | None = None


class ChunkDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCallChunk] | None = None


class ChunkChoice(msgspec.Struct):
    index: int
    delta: ChunkDelta
    logprobs: ChoiceLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    object: str = "chat.completion.chunk"
    system_fingerprint: None = None
    usage: UsageOut | None = None


def choice_out(choice: canonical.Choice) -> ChatChoice:
    message = choice.message
    calls = [
        ToolCallOut(call.id, FunctionOut(call.name, call.arguments))
        for call in message.tool_calls()
    ]
    text = message.text()
    return ChatChoice(
        choice.index,
        AssistantMessage(
            "assistant",
            None if calls and not text else text,
            choice.refusal,
            calls or None,
            message.reasoning,
        ),
        logprobs_out(choice.logprobs),
        choice.finish_reason,
    )


def delta_out(delta: canonical.ChoiceDelta) -> ChunkDelta:
    calls = None
    if delta.tool_calls:
        calls = [
            ToolCallChunk(
                call.index,
                call.id,
                "function" if call.id is not None else None,
                FunctionChunk(call.name, call.arguments),
            )
            for call in delta.tool_calls
        ]
    return ChunkDelta(
        content=delta.text or None,
        reasoning_content=delta.reasoning or None,
        refusal=delta.refusal or None,
        tool_calls=calls,
    )

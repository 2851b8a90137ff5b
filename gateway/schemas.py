"""OpenAI request and response bodies as msgspec structs.

Litestar decodes request bodies into these with msgspec (its validation errors name the field,
which becomes the OpenAI error's ``param``); ``check`` adds the rules a type cannot say.
Responses are encoded with msgspec too; field order and ``null``s follow OpenAI's objects.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from gateway import canonical
from gateway.errors import InvalidRequest

PositiveInt = Annotated[int, Meta(ge=1)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]


class TextPart(msgspec.Struct, forbid_unknown_fields=False):
    type: str
    text: str | None = None


_ROLES: dict[str, canonical.Role] = {
    "system": "system",
    "developer": "developer",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
    "function": "tool",
}


class ChatMessageIn(msgspec.Struct, forbid_unknown_fields=False):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str | None:
        if self.content is None or isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content if part.type == "text")


class StreamOptions(msgspec.Struct, forbid_unknown_fields=False):
    include_usage: bool = False


class _GenerationFields(msgspec.Struct, forbid_unknown_fields=False, kw_only=True):
    """Fields shared by chat and text completions, OpenAI's plus vLLM's extras."""

    model: str
    max_tokens: PositiveInt | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    top_k: int | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None

    def check(self) -> None:
        if self.n is not None and self.n != 1:
            raise InvalidRequest(
                "Only n=1 is supported; send one request per completion.", param="n"
            )
        if self.top_k is not None and self.top_k == 0:
            raise InvalidRequest("top_k must be -1 (disabled) or at least 1.", param="top_k")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest(
                "stream_options is only allowed when stream is true.", param="stream_options"
            )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def canonical_sampling(self) -> canonical.Sampling:
        return canonical.Sampling(
            max_tokens=self.requested_max_tokens(),
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else self.stop or None,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            ignore_eos=self.ignore_eos,
            stop_token_ids=self.stop_token_ids or None,
        )


class ChatCompletionRequest(_GenerationFields, kw_only=True):
    messages: Annotated[list[ChatMessageIn], Meta(min_length=1)]
    max_completion_tokens: PositiveInt | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def canonical(self) -> canonical.ChatRequest:
        return canonical.ChatRequest(
            model=self.model,
            messages=[
                canonical.text_message(_ROLES[m.role], m.text() or "", m.name)
                for m in self.messages
            ],
            sampling=self.canonical_sampling(),
            stream=self.stream,
            include_usage=self.include_usage,
            user=self.user,
        )


class CompletionRequest(_GenerationFields, kw_only=True):
    prompt: str | list[str | int]
    """A string, token ids, or a list holding one string (msgspec allows one list type)."""

    def check(self) -> None:
        super().check()
        if isinstance(self.prompt, list):
            if not self.prompt:
                raise InvalidRequest("prompt must not be empty.", param="prompt")
            strings = sum(isinstance(item, str) for item in self.prompt)
            if strings and (strings != 1 or len(self.prompt) != 1):
                raise InvalidRequest(
                    "prompt must be a string, a list of token ids, or a list with one string.",
                    param="prompt",
                )

    def single_prompt(self) -> str | list[int]:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            return str(self.prompt[0])
        return self.prompt  # type: ignore[return-value]

    def canonical(self) -> canonical.ChatRequest:
        return canonical.ChatRequest(
            model=self.model,
            prompt=self.single_prompt(),
            sampling=self.canonical_sampling(),
            stream=self.stream,
            include_usage=self.include_usage,
            user=self.user,
        )


# ---- responses -------------------------------------------------------------------------------


class UsageOut(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageOut:
        return cls(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)


class AssistantMessage(msgspec.Struct):
    role: str
    content: str
    refusal: None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: None
    finish_reason: str


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageOut
    object: str = "chat.completion"
    system_fingerprint: None = None


class ChunkDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChunkChoice(msgspec.Struct):
    index: int
    delta: ChunkDelta
    logprobs: None
    finish_reason: str | None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    object: str = "chat.completion.chunk"
    system_fingerprint: None = None
    usage: UsageOut | None = None


class TextChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: None
    finish_reason: str | None


class TextCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[TextChoice]
    usage: UsageOut | None = None
    object: str = "text_completion"
    system_fingerprint: None = None


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str
    object: str = "model"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


_encoder = msgspec.json.Encoder()


def encode(value: Any) -> bytes:
    return _encoder.encode(value)


def sse(value: Any) -> bytes:
    """One server-sent event carrying ``value`` as JSON."""
    return b"data: " + _encoder.encode(value) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"

"""OpenAI's legacy text completions: the request, its canonical form, the answer objects."""

from __future__ import annotations

from typing import Any

import msgspec

from sluicegate.gateway import canonical
from sluicegate.gateway.errors import InvalidRequest
from sluicegate.gateway.schemas.bounds import TopLogprobs
from sluicegate.gateway.schemas.sampling import GenerationFields
from sluicegate.gateway.schemas.unknown import unknown_paths
from sluicegate.gateway.schemas.wire import UsageOut


class CompletionRequest(GenerationFields, kw_only=True):
    prompt: str | list[str | int]
    """A string, token ids, or a list holding one string (msgspec allows one list type)."""
    logprobs: TopLogprobs | None = None
    """How many most likely tokens to list beside each sampled one (OpenAI allows 0..5)."""

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

    def canonical(self, document: dict[str, Any]) -> canonical.ChatRequest:
        sampling = self.canonical_sampling()
        if self.logprobs is not None:
            sampling.logprobs = True
            sampling.top_logprobs = self.logprobs
        return canonical.ChatRequest(
            model=self.model,
            prompt=self.single_prompt(),
            sampling=sampling,
            output=self.guided_output(),
            stream=bool(self.stream),
            include_usage=self.include_usage,
            user=self.user,
            extra=unknown_paths(document, CompletionRequest),
            passthrough=document,
        )


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class TextChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class TextCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[TextChoice]
    usage: UsageOut | None = None
    object: str = "text_completion"
    system_fingerprint: None = None

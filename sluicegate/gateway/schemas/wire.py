"""Decoding request bodies and encoding answers: JSON, server-sent events, shared objects."""

from __future__ import annotations

import re
from typing import Any, TypeVar

import msgspec

from sluicegate.gateway.canonical import Usage
from sluicegate.gateway.errors import InvalidRequest

T = TypeVar("T")

_encoder = msgspec.json.Encoder()
_PATH = re.compile(r" - at `(?:key` in `)?\$(?:\.)?([^`]*)`$")
"""Where msgspec says the value was: ``$.field[0]``, or ``key` in `$.field`` for a mapping's
key (the mapping is named)."""
_MISSING_FIELD = re.compile(r"missing required field `([^`]+)`")


def encode(value: Any) -> bytes:
    return _encoder.encode(value)


def sse(value: Any) -> bytes:
    """One server-sent event carrying ``value`` as JSON."""
    return b"data: " + _encoder.encode(value) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def decode_body(raw: bytes, model: type[T]) -> tuple[T, dict[str, Any]]:
    """The body as ``model`` and as plain JSON (what an OpenAI-compatible upstream gets).

    Every failure is a 400 naming the field: not JSON, not an object, nested too deeply for
    the decoder (a RecursionError would otherwise be a 500), or a value ``model`` rejects.
    """
    try:
        document = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"The body is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequest("The body is nested too deeply.") from None
    if not isinstance(document, dict):
        raise InvalidRequest("The body must be a JSON object.")
    try:
        return msgspec.convert(document, model), document
    except msgspec.ValidationError as exc:
        raise invalid(str(exc)) from None
    except RecursionError:
        raise InvalidRequest("The body is nested too deeply.") from None


def invalid(detail: str) -> InvalidRequest:
    """msgspec's validation message as OpenAI's error, ``param`` naming the field."""
    match = _PATH.search(detail)
    # msgspec writes a mapping's value as `[...]`: name the mapping.
    path = match.group(1).split("[...]")[0] if match else ""
    if match and "`key` in" in match.group(0):
        detail = f"{_PATH.sub('', detail)} (a key)"
    else:
        detail = _PATH.sub("", detail)
    missing = _MISSING_FIELD.search(detail)
    if missing:
        path = f"{path}.{missing.group(1)}" if path else missing.group(1)
    if not path:
        return InvalidRequest(f"Invalid request body: {detail}")
    return InvalidRequest(f"Invalid value for '{path}': {detail}", param=path)


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class CompletionTokensDetails(msgspec.Struct):
    reasoning_tokens: int


class UsageOut(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None

    @classmethod
    def of(cls, usage: Usage) -> UsageOut:
        return cls(
            usage.prompt_tokens,
            usage.completion_tokens,
            usage.prompt_tokens + usage.completion_tokens,
            PromptTokensDetails(usage.cached_tokens) if usage.cached_tokens else None,
            CompletionTokensDetails(usage.reasoning_tokens) if usage.reasoning_tokens else None,
        )


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str
    object: str = "model"
    parent: str | None = None
    """A LoRA adapter's base model (as vLLM lists its LoRA modules); null for a model."""


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"

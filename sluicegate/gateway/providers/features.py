"""Which canonical request fields a backend honours, and the 400 naming the first it cannot.

A hosted provider declares the optional features it can carry; ``first_unsupported`` walks a
request and answers the 400 (``param`` in OpenAI's path syntax) for the first set field outside
them, so nothing is ever dropped on the way to a backend.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterator

from sluicegate.gateway.canonical import AudioPart, ChatRequest, FilePart, ImagePart, ToolCall
from sluicegate.gateway.providers.base import ProviderError, unsupported_field


def _set_fields(request: ChatRequest) -> Iterator[tuple[str, str]]:
    """``(feature, param)`` for every optional feature the request uses."""
    s = request.sampling
    scalar = {
        "n": s.n > 1,
        "seed": s.seed is not None,
        "presence_penalty": bool(s.presence_penalty),
        "frequency_penalty": bool(s.frequency_penalty),
        "logit_bias": bool(s.logit_bias),
        "logprobs": s.logprobs or s.top_logprobs is not None,
        "top_k": s.top_k is not None and s.top_k > 0,
        "min_p": bool(s.min_p),
        "repetition_penalty": s.repetition_penalty not in (None, 1.0),
        "ignore_eos": s.ignore_eos,
        "stop_token_ids": bool(s.stop_token_ids),
        "prompt": request.prompt is not None,
        "parallel_tool_calls": request.parallel_tool_calls is False,
        "reasoning_effort": request.reasoning_effort is not None,
        "thinking": request.thinking is not None and request.thinking.type != "disabled",
        "chat_template_kwargs": bool(request.chat_template_kwargs),
        "metadata": bool(request.metadata),
        "service_tier": request.service_tier is not None,
        "store": bool(request.store),
        "modalities": bool(request.modalities) and request.modalities != ["text"],
        "audio": request.audio is not None,
        "prediction": request.prediction is not None,
        "web_search_options": request.web_search_options is not None,
        "verbosity": request.verbosity is not None,
        # Caller identifiers and a cache-routing hint: they never change the answer, and each
        # adapter declares whether it forwards them or, lacking a field for them, goes without
        # by the policy the README's provider table documents.
        "user": request.user is not None,
        "safety_identifier": request.safety_identifier is not None,
        "prompt_cache_key": request.prompt_cache_key is not None,
    }
    for name, used in scalar.items():
        if used:
            yield name, name
    thinking = request.thinking
    if thinking is not None and thinking.type != "disabled" and thinking.display is not None:
        yield "thinking_display", "thinking.display"
    if request.output is not None and request.output.kind != "text":
        yield f"response_format:{request.output.kind}", "response_format"
    if request.tool_choice is not None and request.tool_choice.mode == "none":
        yield "tool_choice:none", "tool_choice"
    for name in request.extra:
        yield f"extra:{name}", name
    for i, message in enumerate(request.messages or ()):
        for j, part in enumerate(message.parts):
            param = f"messages[{i}].content[{j}]"
            if isinstance(part, ImagePart):
                yield ("image" if part.url.startswith("data:") else "image_url"), param
            elif isinstance(part, AudioPart):
                yield "input_audio", param
            elif isinstance(part, FilePart):
                yield "file", param
            elif isinstance(part, ToolCall) and message.role != "assistant":
                yield "tool_call", param


def first_unsupported(
    request: ChatRequest, supported: frozenset[str], backend: str
) -> ProviderError | None:
    for feature, param in _set_fields(request):
        if feature not in supported:
            what = feature.split(":", 1)[-1].replace("_", " ")
            return unsupported_field(param, f"'{param}' ({what}) is not supported by {backend}.")
    return None


def data_url(url: str) -> tuple[str, str]:
    """``(media type, base64 data)`` of a ``data:`` URL; a 400 naming nothing when malformed."""
    head, _, data = url.partition(",")
    if not head.startswith("data:") or not head.endswith(";base64"):
        raise ProviderError(
            "images must be base64 data URLs", status_code=400, code="invalid_request"
        )
    try:
        base64.b64decode(data, validate=True)
    except binascii.Error:
        raise ProviderError(
            "an image's data URL is not valid base64", status_code=400, code="invalid_request"
        ) from None
    return head[5:].removesuffix(";base64"), data

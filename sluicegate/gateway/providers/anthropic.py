"""Anthropic's Messages API as a deployment (``provider: anthropic``).

``x-api-key`` and ``anthropic-version`` headers; streamed answers are Anthropic's named SSE
events, read by ``StreamReader``. Tools, images, JSON-schema output (``output_config.format``),
thinking, ``top_k`` and stop sequences are carried; OpenAI-only options (``n``, ``seed``,
penalties, logprobs, ...) are a 400 naming them.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from sluicegate.gateway.canonical import ChatRequest, Chunk, Response
from sluicegate.gateway.providers.base import ProviderError
from sluicegate.gateway.providers.features import first_unsupported
from sluicegate.gateway.providers.hosted import (
    HostedProvider,
    Sessions,
    StreamGuard,
    json_headers,
    sse_events,
)
from sluicegate.gateway.translate.anthropic_out import StreamReader, messages_body, response_of

DEFAULT_BASE_URL = "https://api.anthropic.com"
API_VERSION = "2023-06-01"

SUPPORTED = frozenset(
    {
        "top_k",
        "parallel_tool_calls",
        "reasoning_effort",
        "thinking",
        "thinking_display",
        "service_tier",
        "response_format:json_schema",
        "tool_choice:none",
        "image",
        "image_url",
        # metadata.user_id (translate/anthropic_out.py); Anthropic has no cache-routing key
        # (its prompt cache is keyed by the prompt itself), so prompt_cache_key goes without.
        "user",
        "safety_identifier",
        "prompt_cache_key",
    }
)

_STATUS_OF_ERROR_EVENT = {"overloaded_error": 529, "rate_limit_error": 429, "api_error": 500}

_COUNTED_FIELDS = frozenset(
    {"model", "messages", "system", "tools", "tool_choice", "thinking", "output_config"}
)
"""What ``/v1/messages/count_tokens`` takes of a Messages body (it refuses ``max_tokens``,
sampling and the rest)."""


class AnthropicProvider(HostedProvider):
    def __init__(
        self,
        *,
        name: str,
        model: str,
        sessions: Sessions,
        api_key: str | None,
        base_url: str = DEFAULT_BASE_URL,
        read_timeout_s: float = 600.0,
    ) -> None:
        super().__init__(name, model, sessions, read_timeout_s)
        self._url = base_url.rstrip("/") + "/v1/messages"
        self._count_url = self._url + "/count_tokens"
        self._headers = json_headers("x-api-key", api_key, extra={"anthropic-version": API_VERSION})

    def unsupported(self, request: ChatRequest) -> ProviderError | None:
        return first_unsupported(request, SUPPORTED, "Anthropic models")

    def _body(self, request: ChatRequest, stream: bool) -> bytes:
        body = messages_body(request, self.model)
        if stream:
            body["stream"] = True
        return json.dumps(body).encode()

    async def complete(self, request: ChatRequest) -> Response:
        body = self._body(request, False)
        return await self._answer(request, self._url, self._headers, body, response_of)

    async def count_tokens(self, request: ChatRequest) -> int:
        """Anthropic's own count of the prompt (``/v1/messages/count_tokens``)."""
        body = messages_body(request, self.model)
        counted = json.dumps({k: v for k, v in body.items() if k in _COUNTED_FIELDS}).encode()
        return await self._answer(
            request, self._count_url, self._headers, counted, lambda b: int(b["input_tokens"])
        )

    async def generate(self, request: ChatRequest) -> AsyncIterator[Chunk]:
        reader = StreamReader()
        guard = StreamGuard(self.name)
        async with self._http.stream(
            self._url, self._headers, self._body(request, True), deadline=request.deadline
        ) as resp:
            with guard.reading():
                async for name, data in sse_events(resp):
                    event = json.loads(data)
                    if name == "error" or event.get("type") == "error":
                        error = event.get("error") or {}
                        status = _STATUS_OF_ERROR_EVENT.get(error.get("type"), 500)
                        raise guard.upstream_error(status, error.get("message", ""))
                    chunk = reader.read(event)
                    if chunk is not None:
                        yield guard.saw(chunk)
                    if event.get("type") == "message_stop":
                        return
        raise guard.ended_early()

"""Azure OpenAI as a deployment (``provider: azure``).

Azure speaks OpenAI's chat/completions wire format at its own addresses:
``{endpoint}/openai/deployments/{deployment}/chat/completions?api-version=...`` for a classic
deployment, or ``{endpoint}/openai/v1/chat/completions`` (model in the body) for the v1 API;
the key goes in the ``api-key`` header. A request that came in by OpenAI's API is forwarded
field for field; others are built from the canonical model (translate/openai_out.py).
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
    with_traceparent,
)
from sluicegate.gateway.translate.openai_out import chat_body, chunk_of, response_of

DEFAULT_API_VERSION = "2024-10-21"

SUPPORTED = frozenset(
    {
        "n",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "logprobs",
        "parallel_tool_calls",
        "reasoning_effort",
        "metadata",
        "user",
        "safety_identifier",
        "prompt_cache_key",
        "service_tier",
        "response_format:json_object",
        "response_format:json_schema",
        "tool_choice:none",
        "image",
        "image_url",
        "input_audio",
        "file",
    }
)


class AzureProvider(HostedProvider):
    def __init__(
        self,
        *,
        name: str,
        endpoint: str,
        model: str,
        sessions: Sessions,
        api_key: str | None,
        deployment: str | None = None,
        api_version: str = DEFAULT_API_VERSION,
        read_timeout_s: float = 600.0,
    ) -> None:
        super().__init__(name, model, sessions, read_timeout_s)
        endpoint = endpoint.rstrip("/")
        if deployment:
            self._url = (
                f"{endpoint}/openai/deployments/{deployment}/chat/completions"
                f"?api-version={api_version}"
            )
            self._body_model: str | None = None  # the deployment names the model
        else:
            self._url = f"{endpoint}/openai/v1/chat/completions"
            self._body_model = model
        self._headers = json_headers("api-key", api_key)

    def unsupported(self, request: ChatRequest) -> ProviderError | None:
        if request.passthrough is not None:
            return None  # OpenAI's own body: Azure takes OpenAI's fields
        return first_unsupported(request, SUPPORTED, "Azure OpenAI")

    async def complete(self, request: ChatRequest) -> Response:
        body = json.dumps(chat_body(request, self._body_model, stream=False)).encode()
        headers = with_traceparent(self._headers, request.traceparent)
        return await self._answer(request, self._url, headers, body, response_of)

    async def generate(self, request: ChatRequest) -> AsyncIterator[Chunk]:
        """Azure's chunks as they came (``raw`` kept, so an OpenAI client gets them as is)."""
        body = json.dumps(chat_body(request, self._body_model, stream=True)).encode()
        guard = StreamGuard(self.name, "chunk")
        finished = False
        headers = with_traceparent(self._headers, request.traceparent)
        async with self._http.stream(self._url, headers, body, deadline=request.deadline) as resp:
            with guard.reading():
                async for _, data in sse_events(resp):
                    if data.strip() == "[DONE]":
                        break
                    chunk = guard.saw(chunk_of(json.loads(data)))
                    finished = finished or chunk.finish_reason() is not None
                    yield chunk
        if not finished:
            raise guard.ended_early()

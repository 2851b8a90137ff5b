"""What every provider takes and yields, so routing and the API never care which one serves.

A provider turns one ``GenerationRequest`` into an async stream of ``GenerationChunk``; the
last chunk has ``finish_reason`` and ``usage``. Failures raise ``ProviderError``: ``retryable``
errors before the first chunk let the router fall back to the next deployment.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from engine.protocol import ChatMessage, Sampling, Usage


@dataclass
class GenerationRequest:
    request_id: str
    model: str
    """The deployment's model name (the upstream's or the workers' served name)."""
    sampling: Sampling
    messages: list[ChatMessage] | None = None
    prompt: str | list[int] | None = None
    deadline: float = 0.0
    traceparent: str | None = None
    user: str | None = None


@dataclass
class GenerationChunk:
    text: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None
    num_tokens: int = 0
    """Completion tokens carried by this chunk, when the provider knows them."""
    prompt_tokens: int = 0
    """The prompt's real token count once the provider knows it (0 = unknown), so a request
    cut short is billed its real prompt rather than the admission estimate."""


@dataclass
class ProviderError(Exception):
    message: str
    retryable: bool = False
    """True when nothing was generated and another deployment may serve the request."""
    status_code: int = 502
    code: str = "upstream_error"
    usage: Usage | None = None
    """Tokens already delivered before the failure, for billing."""
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.message


class Provider(Protocol):
    name: str
    """The deployment's name, for metrics, cooldowns and usage records."""

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]: ...

    async def is_available(self) -> bool:
        """Whether this deployment can take a request now (e.g. a live engine worker)."""
        ...

    async def close(self) -> None: ...

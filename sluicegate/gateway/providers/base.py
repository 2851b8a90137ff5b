"""What every provider takes and yields, so routing and the API never care which one serves.

A provider turns one canonical ``ChatRequest`` into an async stream of ``Chunk``; the last
chunk carries the finish reasons and ``usage``. A provider may also answer a whole request at
once (``complete``, returning a ``Response``). Failures raise ``ProviderError``: ``retryable``
errors before the first chunk let the router fall back to the next deployment. ``unsupported``
says, before anything is sent, which field of a request the backend cannot honour.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from sluicegate.gateway.canonical import ChatRequest, Chunk, Usage


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
    param: str | None = None
    """The request field at fault (OpenAI's path syntax, e.g. ``messages[1].content[0]``)."""
    retry_after_s: float | None = None
    """How long the upstream asked us to wait before trying it again (its ``retry-after``)."""
    counts_toward_cooldown: bool = True
    """False for a failure that says nothing about the deployment itself (our engines' Redis
    unreachable for a moment, no worker at this instant): its availability is read afresh for
    every request, so a cooldown would only stretch a blip into ``cooldown_s`` of 503s."""

    def __str__(self) -> str:
        return self.message


def unsupported_field(param: str, message: str) -> ProviderError:
    """The 400 for a field a backend cannot honour."""
    return ProviderError(message, status_code=400, code="invalid_request", param=param)


class Provider(Protocol):
    name: str
    """The deployment's name, for metrics, cooldowns and usage records."""

    def generate(self, request: ChatRequest) -> AsyncIterator[Chunk]: ...

    def unsupported(self, request: ChatRequest) -> ProviderError | None:
        """The 400 for the first field of ``request`` this backend cannot honour, if any."""
        ...

    async def is_available(self) -> bool:
        """Whether this deployment can take a request now (e.g. a live engine worker)."""
        ...

    async def close(self) -> None: ...

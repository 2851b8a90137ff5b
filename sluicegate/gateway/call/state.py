"""What one admitted request carries from admission to settlement: the part of a ``Call`` that
its settlement (``sluicegate.gateway.call.settle``) and its spans read."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from opentelemetry.trace import Span

from sluicegate.gateway.admission.limits import Admission
from sluicegate.gateway.canonical import ChatRequest, Chunk, Usage
from sluicegate.gateway.keys.records import ApiKeyRecord
from sluicegate.gateway.routing.router import Deployment, ModelRoute
from sluicegate.gateway.services import Services


@dataclass(slots=True)
class CallState:
    """What is known of one admitted generation: its request, its admission, how far it got."""

    services: Services
    key: ApiKeyRecord
    route: ModelRoute
    request: ChatRequest
    admission: Admission
    request_id: str
    response_id: str
    created: int
    public_model: str
    prompt_estimate: int
    prompt_param: str
    """The request field holding the prompt, named by a context-length error."""
    started: float
    span: Span
    prefetched: asyncio.Task[Any] | None = None
    """The whole answer's fetch, sent upstream while admission was in Redis
    (``sluicegate.gateway.admission.speculation``)."""
    generation_started: float = 0.0
    deployment: Deployment | None = None
    delivered_tokens: int = 0
    first_token_at: float | None = None
    finish_reason: str | None = None
    usage: Usage | None = None
    prompt_tokens: int = 0
    """The provider's real prompt count, once a chunk reported it."""
    status: str = "cancelled"
    """Stays ``cancelled`` unless the stream ran to its end (ok) or failed (error)."""
    finished: bool = False
    adapter: str | None = None
    """The LoRA adapter (``base:adapter``) it runs with, for its usage record."""

    def billed(self) -> Usage:
        """Real counts when known; else the prompt estimate plus what reached the client —
        nothing at all when no token was generated."""
        if self.usage is not None:
            if self.status == "ok":
                return self.usage
            return Usage(self.usage.prompt_tokens, self.delivered_tokens)
        if self.first_token_at is None:
            return Usage(0, 0)
        return Usage(self.prompt_tokens or self.prompt_estimate, self.delivered_tokens)

    def chunk_received(self, chunk: Chunk) -> None:
        # The answer begins with output or its finish, not with a chunk that only opens the
        # stream (a role, Anthropic's message_start): TTFT is measured, and a stream that
        # fails later billed, from there.
        if self.first_token_at is None and chunk.is_answer():
            self.first_token_at = time.perf_counter()
        if chunk.has_output():
            # A chunk with output counts at least one token, whatever its upstream reported.
            self.delivered_tokens += chunk.num_tokens if chunk.num_tokens > 0 else 1
        finish_reason = chunk.finish_reason()
        if finish_reason and self.finish_reason is None:
            self.finish_reason = finish_reason
        if chunk.prompt_tokens > 0:
            self.prompt_tokens = chunk.prompt_tokens
        if chunk.usage is not None:
            self.usage = chunk.usage
        if self.services.leases is not None:
            self.services.leases.progress(
                self.request_id,
                prompt_tokens=self.prompt_tokens,
                delivered_tokens=self.delivered_tokens,
                first_token=self.first_token_at is not None,
                deployment=self.deployment.name if self.deployment else None,
                # Our engines' provider names its reply stream (a reaper reads how far).
                reply_to=getattr(self.deployment.provider, "reply_stream", "")
                if self.deployment
                else "",
            )

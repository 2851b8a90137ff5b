"""A request's stream through ``Router.serve``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from sluicegate.gateway.canonical import ChatRequest, Chunk
from sluicegate.gateway.providers.base import ProviderError
from sluicegate.gateway.routing.config import Deployment, ModelRoute
from sluicegate.gateway.telemetry import UPSTREAM_ERRORS

Opened = tuple[AsyncIterator[Chunk], list[Chunk]]
Serve = Callable[..., Awaitable[tuple[Deployment, Any]]]
"""``Router.serve``: runs a start function on deployments in fallback order."""


class Generation:
    """One request's stream through ``Router.serve``; ``deployment`` names who serves it."""

    def __init__(self, serve: Serve, route: ModelRoute, request: ChatRequest) -> None:
        self._serve = serve
        self._route = route
        self._request = request
        self.deployment: Deployment | None = None
        self._iterator = self._run()

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self._iterator

    async def aclose(self) -> None:
        await self._iterator.aclose()

    async def _start(self, deployment: Deployment) -> Opened:
        """Opens ``deployment``'s stream and reads it up to the chunk that begins the answer
        (``Chunk.is_answer``), keeping the chunks before it. Only then is the deployment
        chosen: an upstream that opens its stream (Anthropic's ``message_start``, OpenAI's
        role-only chunk) and then reports an overload has answered nothing yet, so its error
        still goes back to ``Router.serve`` to be retried or moved past."""
        self.deployment = deployment
        chunks = aiter(deployment.provider.generate(self._request))
        opening: list[Chunk] = []
        try:
            while True:
                chunk = await anext(chunks)
                opening.append(chunk)
                if chunk.is_answer():
                    return chunks, opening
        except StopAsyncIteration:
            await chunks.aclose()  # type: ignore[attr-defined]
            raise ProviderError(
                f"{deployment.name} ended without an answer", retryable=True
            ) from None
        except BaseException:
            await chunks.aclose()  # type: ignore[attr-defined]
            raise

    async def _run(self) -> AsyncIterator[Chunk]:
        deployment, (chunks, opening) = await self._serve(
            self._route, self._request, self._start, hold=True
        )
        self.deployment = deployment
        try:
            for chunk in opening:
                yield chunk
            async for chunk in chunks:
                yield chunk
        except ProviderError as exc:
            if exc.retryable or exc.status_code >= 500:
                UPSTREAM_ERRORS.labels(deployment.name).inc()
            raise
        finally:
            deployment.outstanding -= 1
            await chunks.aclose()  # type: ignore[attr-defined]

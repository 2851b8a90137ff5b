"""One admitted request, from admission to settlement, shared by every inbound API.

A controller turns its body into a canonical ``ChatRequest`` and calls ``admit``
(``sluicegate.gateway.admission.admit``), which books the key's limits and returns a ``Call`` owning the
reservation. ``Call.complete`` / ``count`` / ``embed`` ask the router (which falls back between
deployments before the first token) for a whole answer; ``sluicegate.gateway.call.stream`` relays a
streamed one. Both answer through the controller's ``Renderer`` — the only part that knows the
inbound API's wire shape. ``chunk_received`` keeps the call's progress (and its lease's) as
chunks arrive. ``Call.finish`` settles the reservation with the real token counts and appends
the usage event (``sluicegate.gateway.call.settle``). It runs for every admitted request, whether it
succeeded, failed or was cancelled by the client (then only delivered tokens are billed).
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

import anyio
from litestar import Response

from sluicegate.gateway.call.settle import settle
from sluicegate.gateway.call.state import CallState
from sluicegate.gateway.canonical import Chunk, Usage
from sluicegate.gateway.canonical import Response as Answer
from sluicegate.gateway.errors import (
    ContextLengthExceeded,
    InvalidRequest,
    OpenAIError,
    ServiceUnavailable,
    UpstreamError,
)
from sluicegate.gateway.http.json_response import JSONBytes
from sluicegate.gateway.providers.base import ProviderError
from sluicegate.gateway.routing.router import Deployment
from sluicegate.gateway.schemas.wire import encode
from sluicegate.gateway.telemetry import ADDED_LATENCY

T = TypeVar("T")

DEPLOYMENT_HEADER = "x-sluicegate-deployment"


class Renderer(Protocol):
    """An inbound API's wire shape for answers; one per controller."""

    def whole(self, call: Call, answer: Answer) -> bytes:
        """The body of a non-streamed answer."""
        ...

    def opening(self, call: Call, first: Chunk) -> bytes:
        """What a stream starts with, before the ``first`` chunk (may be empty)."""
        ...

    def chunk(self, call: Call, chunk: Chunk) -> bytes:
        """One chunk's events (empty when it carries nothing to show)."""
        ...

    def closing(self, call: Call) -> bytes:
        """What follows the last chunk of a stream that ended well."""
        ...

    def error(self, call: Call, error: OpenAIError) -> bytes:
        """The event telling a streaming client that the stream failed."""
        ...


def public_error(exc: ProviderError, param: str) -> OpenAIError:
    """A provider's failure as the client sees it; ``param`` names the prompt field."""
    if exc.code == "context_length_exceeded":
        return ContextLengthExceeded(exc.message, param=param)
    if exc.status_code == 400:
        return InvalidRequest(exc.message, param=exc.param)
    if exc.status_code == 503:
        return ServiceUnavailable(exc.message)
    return UpstreamError(exc.message)


def with_headers(exc: OpenAIError, headers: dict[str, str]) -> OpenAIError:
    """``exc`` carrying the admission's limit headers (those it set itself win)."""
    for name, value in headers.items():
        exc.headers.setdefault(name, value)
    return exc


class Call(CallState):
    """One admitted generation, from admission to settlement."""

    __slots__ = ()

    # ---- answering -------------------------------------------------------------------------

    async def _answer(self, fetch: Awaitable[tuple[Deployment, T]]) -> T:
        """Await a whole answer; any failure settles the call and becomes the client's error."""
        if self.prefetched is None:
            self.generation_started = time.perf_counter()
        try:
            self.deployment, answer = await fetch
        except ProviderError as exc:
            self.status = "error"
            await self.finish()
            error = public_error(exc, self.prompt_param)
            raise with_headers(error, self.admission.headers) from None
        except OpenAIError as exc:
            self.status = "error"
            await self.finish()
            raise with_headers(exc, self.admission.headers) from None
        except BaseException:
            self.status = "cancelled"
            await self.finish_shielded()
            raise
        self.first_token_at = time.perf_counter()
        return answer

    async def _respond(self, content: bytes) -> Response[bytes]:
        generated = self.first_token_at or time.perf_counter()
        self.status = "ok"
        added = (self.generation_started - self.started) + (time.perf_counter() - generated)
        if self.batch_line is not None:
            self.batch_line.settlement = self._answered(added)
        else:
            self.services.settle_soon(self._answered(added))
        return JSONBytes(content, headers=self.response_headers())

    async def _answered(self, added_latency: float) -> None:
        """After a whole answer went out: its metric, then its settlement."""
        ADDED_LATENCY.observe(added_latency)
        await self.finish()

    async def complete(self, renderer: Renderer) -> Response[bytes]:
        answer = await self._answer(
            self.prefetched or self.services.router.complete(self.route, self.request)
        )
        self.delivered_tokens = max(answer.num_tokens, 0)
        self.finish_reason = answer.finish_reason() or "stop"
        # An upstream that reports no usage is billed by the same estimate as prompts (chars/3).
        self.usage = answer.usage or Usage(
            self.prompt_estimate, answer.num_tokens or math.ceil(len(answer.text()) / 3)
        )
        return await self._respond(await self._render(lambda: renderer.whole(self, answer)))

    async def count(self) -> int:
        """The prompt's tokens as the deployment that would serve it counts them. A count
        endpoint's answer settles at zero tokens (still a request toward the key's request-rate
        limit, with a usage row); a backend measured by a one-token generation (counting.py)
        is billed that generation, as any request (the estimate where it reported no usage)."""
        counted = await self._answer(self.services.router.count_tokens(self.route, self.request))
        if counted.generated:
            self.usage = counted.usage or Usage(self.prompt_estimate, 1)
        else:
            self.usage = Usage(0, 0)
        self.status = "ok"
        await self.finish()
        return counted.tokens if counted.tokens is not None else self.prompt_estimate

    async def embed(self) -> Response[bytes]:
        """Embeddings: the upstream's object, ``model`` named as the client asked."""
        raw, usage = await self._answer(
            self.prefetched or self.services.router.embed(self.route, self.request)
        )
        self.usage = usage or Usage(self.prompt_estimate, 0)
        return await self._respond(
            await self._render(lambda: encode({**raw, "model": self.public_model}))
        )

    async def _render(self, render: Callable[[], bytes]) -> bytes:
        """A whole answer's body. When rendering fails the client gets a 500 and nothing of
        the answer: settle that before the error leaves (``_respond`` would have)."""
        try:
            return render()
        except Exception:
            self.status = "error"
            self.delivered_tokens = 0
            await self.finish()
            raise

    def response_headers(self) -> dict[str, str]:
        """The limit headers, and the deployment that served (names, never addresses)."""
        if self.deployment is None:
            return self.admission.headers
        return {**self.admission.headers, DEPLOYMENT_HEADER: self.deployment.name}

    # ---- settling --------------------------------------------------------------------------

    async def finish_shielded(self) -> None:
        """``finish`` from a task being cancelled: shielded so its Redis calls complete."""
        with anyio.CancelScope(shield=True):
            await self.finish()

    async def finish(self) -> None:
        """Settle the reservation, record usage, count metrics — exactly once."""
        if self.finished:
            return
        self.finished = True
        await settle(self)

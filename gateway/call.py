"""One request's lifecycle, shared by every inbound API: admit, route, relay, settle, bill, trace.

The ``authenticate`` guard finds the key (in-process cache, no database once cached) before the
body is read. A controller turns its body into a canonical ``ChatRequest`` and calls ``admit``:
the model is resolved, the deployments asked whether they can honour the request, every limit
of the key booked in one Redis call. ``Call.complete`` / ``Call.stream`` then ask the router
(which falls back between deployments before the first token) and answer through the
controller's ``Renderer`` — the only part that knows the inbound API's wire shape.
``Call.finish`` settles the reservation with the real token counts and appends the usage event
in one pipelined round trip. It runs for every admitted request, whether it succeeded, failed
or was cancelled by the client (then only delivered tokens are billed).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import anyio
from litestar import Request, Response
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream
from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind
from redis.exceptions import RedisError

from engine.tracing import tracing_enabled
from gateway.auth import ApiKeyRecord
from gateway.canonical import ChatRequest, Chunk, Usage
from gateway.canonical import Response as Answer
from gateway.errors import (
    ContextLengthExceeded,
    InvalidRequest,
    ModelNotFound,
    OpenAIError,
    PermissionDenied,
    ServiceUnavailable,
    UpstreamError,
)
from gateway.limits import Admission
from gateway.providers.base import ProviderError
from gateway.routing import Deployment, ModelRoute
from gateway.schemas.wire import encode
from gateway.services import Services
from gateway.settle import settle
from gateway.telemetry import (
    ADDED_LATENCY,
    child_context,
    current_traceparent,
    genai_request_attributes,
    tracer,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

JSON = "application/json"
DEPLOYMENT_HEADER = "x-sluicegate-deployment"
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
TEXT_COMPLETION_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for text completions."""
_TOKEN_OVERHEAD_PER_MESSAGE = 4
"""Chat templates wrap every message in a few special tokens."""


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


def prompt_token_estimate(request: ChatRequest) -> int:
    """Admission's guess of the prompt's tokens (chars / 3), before any tokenizer saw it."""
    if request.messages is not None:
        chars = sum(len(m.text()) for m in request.messages)
        return math.ceil(chars / 3) + _TOKEN_OVERHEAD_PER_MESSAGE * len(request.messages)
    prompt = request.prompt
    return len(prompt) if isinstance(prompt, list) else math.ceil(len(prompt or "") / 3)


def public_error(exc: ProviderError, param: str) -> OpenAIError:
    """A provider's failure as the client sees it; ``param`` names the prompt field."""
    if exc.code == "context_length_exceeded":
        return ContextLengthExceeded(exc.message, param=param)
    if exc.status_code == 400:
        return InvalidRequest(exc.message, param=exc.param)
    if exc.status_code == 503:
        return ServiceUnavailable(exc.message)
    return UpstreamError(exc.message)


def _with_headers(exc: OpenAIError, headers: dict[str, str]) -> OpenAIError:
    for name, value in headers.items():
        exc.headers.setdefault(name, value)
    return exc


_SERVES = {"chat": "chat or text completions", "embeddings": "embeddings"}


def _refusal(route: ModelRoute, body: ChatRequest, mode: str) -> OpenAIError | None:
    """Why no deployment of ``route`` can take ``body`` (the first one's reason), if so."""
    first: ProviderError | None = None
    serving = [d for d in route.deployments if d.mode == mode]
    if not serving:
        return ModelNotFound(
            f"The model '{body.model}' has no deployment serving {_SERVES[mode]}.",
            param="model",
        )
    for deployment in serving:
        problem = deployment.provider.unsupported(body)
        if problem is None:
            return None
        first = first or problem
    assert first is not None
    return InvalidRequest(first.message, param=first.param)


async def admit(
    request: Request[Any, Any, Any],
    body: ChatRequest,
    *,
    operation: str,
    id_prefix: str,
    mode: str = "chat",
) -> Call:
    """Resolve, authorise and book ``body``; the returned call owns the reservation."""
    services: Services = request.app.state.services
    state = request.scope["state"]
    key: ApiKeyRecord = state["api_key"]
    request_id = state["request_id"]
    # One span for auth + admission, begun when the guard began authenticating. Without
    # tracing no span is made at all (even a no-op one costs a context and a propagation).
    tracing = tracing_enabled()
    parent = child_context(state.get("server_span"))
    admission_span = (
        tracer().start_span(
            "gateway.auth_and_admission", context=parent, start_time=state["auth_started_ns"]
        )
        if tracing
        else INVALID_SPAN
    )
    chat = body.messages is not None
    try:
        route = await services.router.resolve(body.model)
        if route is None:
            raise ModelNotFound(
                f"The model '{body.model}' does not exist or you do not have access to it.",
                param="model",
            )
        if not (key.allows_model(route.name) or key.allows_model(body.model)):
            raise PermissionDenied(
                f"This API key may not use the model '{body.model}'.", param="model"
            )
        refusal = _refusal(route, body, mode)
        if refusal is not None:
            raise refusal
        if mode == "embeddings":
            max_tokens = 0
        else:
            # Without a cap from the client, reserve the default cap; settling corrects it.
            max_tokens = body.sampling.max_tokens or (
                services.settings.default_max_tokens if chat else TEXT_COMPLETION_MAX_TOKENS
            )
        prompt_estimate = prompt_token_estimate(body)
        try:
            leases, draft = services.leases, None
            if leases is not None:
                # The admission script stores the lease (gateway.leases): no round trip of its own.
                draft = await leases.draft(
                    key,
                    model=body.model,
                    prompt_estimate=prompt_estimate,
                    started_at=time.time() - (time.perf_counter() - state["started"]),
                )
            admission = await services.limiter.admit(
                key,
                request_id,
                prompt_estimate + max_tokens * body.sampling.n,
                model=route.name,
                prompt_tokens=prompt_estimate,
                lease=draft,
            )
            if leases is not None and draft is not None:
                await leases.opened(draft, admission)
        except RedisError as exc:
            raise ServiceUnavailable(
                "Rate limiting is unavailable (Redis unreachable); try again shortly."
            ) from exc
        if admission_span.is_recording():
            admission_span.set_attribute("sluicegate.key_id", key.id)
    except OpenAIError as exc:
        if admission_span.is_recording():
            admission_span.set_attribute("error.type", exc.code or exc.error_type)
        raise
    finally:
        admission_span.end()

    span = (
        tracer().start_span(f"{operation} {route.name}", context=parent, kind=SpanKind.CLIENT)
        if tracing
        else INVALID_SPAN
    )
    if span.is_recording():
        temperature = body.sampling.temperature
        span.set_attributes(
            genai_request_attributes(
                operation,
                "sluicegate",
                route.name,
                max_tokens,
                1.0 if temperature is None else temperature,
            )
        )
        if services.settings.otel_capture_content:
            content = body.messages if chat else body.prompt
            span.set_attribute("gen_ai.input.messages", encode(content).decode())
    if tracing:
        with trace.use_span(span, end_on_exit=False):
            body.traceparent = current_traceparent()
    body.request_id = request_id
    body.deadline = time.time() + services.settings.request_timeout_s
    return Call(
        services=services,
        key=key,
        route=route,
        request=body,
        admission=admission,
        request_id=request_id,
        response_id=id_prefix + request_id,
        created=int(time.time()),
        public_model=body.model,
        prompt_estimate=prompt_estimate,
        prompt_param="input" if mode == "embeddings" else "messages" if chat else "prompt",
        started=state["started"],
        span=span,
    )


@dataclass(slots=True)
class Call:
    """One admitted generation, from admission to settlement."""

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
            self.delivered_tokens += chunk.num_tokens or 1
        finish_reason = chunk.finish_reason()
        if finish_reason and self.finish_reason is None:
            self.finish_reason = finish_reason
        if chunk.prompt_tokens:
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
            )

    # ---- answering -------------------------------------------------------------------------

    async def _answer(self, fetch: Awaitable[tuple[Deployment, T]]) -> T:
        """Await a whole answer; any failure settles the call and becomes the client's error."""
        self.generation_started = time.perf_counter()
        try:
            self.deployment, answer = await fetch
        except ProviderError as exc:
            self.status = "error"
            await self.finish()
            error = public_error(exc, self.prompt_param)
            raise _with_headers(error, self.admission.headers) from None
        except OpenAIError as exc:
            self.status = "error"
            await self.finish()
            raise _with_headers(exc, self.admission.headers) from None
        except BaseException:
            self.status = "cancelled"
            await self.finish_shielded()
            raise
        self.first_token_at = time.perf_counter()
        return answer

    async def _respond(self, content: bytes) -> Response[bytes]:
        generated = self.first_token_at or time.perf_counter()
        self.status = "ok"
        await self.finish()
        ADDED_LATENCY.observe(
            (self.generation_started - self.started) + (time.perf_counter() - generated)
        )
        return Response(content, status_code=200, media_type=JSON, headers=self._headers())

    async def complete(self, renderer: Renderer) -> Response[bytes]:
        answer = await self._answer(self.services.router.complete(self.route, self.request))
        self.delivered_tokens = answer.num_tokens
        self.finish_reason = answer.finish_reason() or "stop"
        # An upstream that reports no usage is billed by the same estimate as prompts (chars/3).
        self.usage = answer.usage or Usage(
            self.prompt_estimate, answer.num_tokens or math.ceil(len(answer.text()) / 3)
        )
        self.status = "ok"
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
        raw, usage = await self._answer(self.services.router.embed(self.route, self.request))
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

    async def stream(self, renderer: Renderer) -> Stream:
        services = self.services
        self.generation_started = time.perf_counter()
        generation = services.router.stream(self.route, self.request)
        chunks = aiter(generation)
        try:
            # The first chunk is awaited before answering, so failing to start is an HTTP
            # error (with fallback inside the router), not a 200 with an error event.
            first = await anext(chunks)
        except ProviderError as exc:
            self.deployment = generation.deployment
            self.status = "error"
            await generation.aclose()
            await self.finish()
            error = public_error(exc, self.prompt_param)
            raise _with_headers(error, self.admission.headers) from None
        except (OpenAIError, StopAsyncIteration) as exc:
            self.status = "error"
            await generation.aclose()
            await self.finish()
            if isinstance(exc, OpenAIError):
                raise _with_headers(exc, self.admission.headers) from None
            raise _with_headers(
                UpstreamError("The deployment ended the stream without an answer."),
                self.admission.headers,
            ) from None
        except BaseException:
            with anyio.CancelScope(shield=True):
                await generation.aclose()
            await self.finish_shielded()
            raise
        self.deployment = generation.deployment
        self.chunk_received(first)
        ADDED_LATENCY.observe(self.generation_started - self.started)
        events = self._events(renderer, chunks, first)

        async def close() -> None:
            # Runs after the response, also when the client went away: closing the generators
            # cancels the upstream call; finish bills what was delivered.
            await events.aclose()
            await generation.aclose()
            await self.finish()

        return Stream(
            events,
            media_type="text/event-stream",
            headers={**SSE_HEADERS, **self._headers()},
            background=BackgroundTask(close),
        )

    def _headers(self) -> dict[str, str]:
        """The limit headers, and the deployment that served (names, never addresses)."""
        if self.deployment is None:
            return self.admission.headers
        return {**self.admission.headers, DEPLOYMENT_HEADER: self.deployment.name}

    async def _events(
        self, renderer: Renderer, chunks: AsyncIterator[Chunk], first: Chunk
    ) -> AsyncIterator[bytes]:
        """The stream's bytes; cancelled mid-way when the client disconnects (``finish``
        bills that). Rendering is inside the guard too: whatever fails, the client gets its
        API's error event and the stream ends normally, so ``close`` settles it."""
        chunk: Chunk | None = first
        try:
            opening = renderer.opening(self, first)
            if opening:
                yield opening
            while chunk is not None:
                data = renderer.chunk(self, chunk)
                if data:
                    yield data
                chunk = await anext(chunks, None)
                if chunk is not None:
                    self.chunk_received(chunk)
            self.status = "ok"
            self.finish_reason = self.finish_reason or "stop"
            if self.usage is None:
                self.usage = Usage(
                    self.prompt_tokens or self.prompt_estimate, self.delivered_tokens
                )
            closing = renderer.closing(self)
        except ProviderError as exc:
            self.status = "error"
            if exc.usage is not None:
                self.usage = exc.usage
            yield renderer.error(self, public_error(exc, self.prompt_param))
            return
        except Exception:
            # Whatever broke, the client gets its API's error event and the request is settled.
            logger.exception("stream %s failed", self.request_id)
            self.status = "error"
            failure = UpstreamError("The server had an error while streaming the response.")
            failure.error_type = "server_error"
            yield renderer.error(self, failure)
            return
        yield closing

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

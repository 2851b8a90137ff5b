"""The OpenAI-compatible routes: chat completions, text completions, models.

One request: the ``authenticate`` guard finds the key (in-process cache, no database once
cached) before the body is even read; the handler resolves the model, books every limit of
the key in one Redis call, asks the router (which falls back between deployments before the
first token), and answers — a whole object, or server-sent events exactly as OpenAI sends
them. ``finish`` then settles the reservation with the real token counts and appends the
usage event in one pipelined round trip. It runs for every admitted request, whether it
succeeded, failed or was cancelled by the client (then only delivered tokens are billed).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
from litestar import Controller, Request, Response, get, post
from litestar.background_tasks import BackgroundTask
from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler
from litestar.params import JSONBody
from litestar.response import Stream
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind
from redis.asyncio import Redis
from redis.exceptions import RedisError

from engine.protocol import Usage
from engine.tracing import tracing_enabled
from gateway.auth import ApiKeyRecord, provide_api_key
from gateway.errors import (
    ContextLengthExceeded,
    InvalidRequest,
    ModelNotFound,
    OpenAIError,
    PermissionDenied,
    ServiceUnavailable,
    UpstreamError,
)
from gateway.limits import Admission, RateLimiter
from gateway.providers.base import GenerationChunk, GenerationRequest, ProviderError
from gateway.routing import Deployment, ModelRoute, Router
from gateway.schemas import (
    SSE_DONE,
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChunkChoice,
    ChunkDelta,
    CompletionRequest,
    ModelCard,
    ModelList,
    TextChoice,
    TextCompletion,
    UsageOut,
    encode,
    sse,
)
from gateway.settings import Settings
from gateway.telemetry import (
    ADDED_LATENCY,
    child_context,
    current_traceparent,
    genai_request_attributes,
    genai_response_attributes,
    model_metrics,
    start_server_span,
    tracer,
)
from gateway.usage import UsageEvent, UsageRecorder

logger = logging.getLogger(__name__)

JSON = "application/json"
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def new_request_id() -> str:
    return os.urandom(12).hex()


def request_state(scope: Any) -> dict[str, Any]:
    """Per-request values of ours (request id, start time, key) in the ASGI scope state."""
    state = scope.get("state")
    if state is None:
        state = scope["state"] = {}
    return state  # type: ignore[no-any-return]


@dataclass(slots=True)
class Services:
    """What the request path needs, built once by the app's lifespan."""

    settings: Settings
    router: Router
    limiter: RateLimiter
    recorder: UsageRecorder
    redis: Redis
    started_at: int = field(default_factory=lambda: int(time.time()))


async def authenticate(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """Guard: runs before the body is read, so a bad key is a 401 whatever the body says."""
    scope = connection.scope
    state = request_state(scope)
    state["started"] = time.perf_counter()
    state["request_id"] = new_request_id()
    state["auth_started_ns"] = now_ns = time.time_ns()
    if tracing_enabled():
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        state["server_span"] = start_server_span(
            f"{scope['method']} {scope['path']}", headers, now_ns
        )
    state["api_key"] = await provide_api_key(connection)  # type: ignore[arg-type]


@dataclass(slots=True)
class Call:
    """One admitted generation, from admission to settlement."""

    services: Services
    key: ApiKeyRecord
    route: ModelRoute
    admission: Admission
    request_id: str
    response_id: str
    created: int
    public_model: str
    prompt_estimate: int
    include_usage: bool
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

    def chunk_received(self, chunk: GenerationChunk) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        if chunk.text:
            self.delivered_tokens += chunk.num_tokens or 1
        if chunk.finish_reason:
            self.finish_reason = chunk.finish_reason
        if chunk.prompt_tokens:
            self.prompt_tokens = chunk.prompt_tokens
        if chunk.usage is not None:
            self.usage = chunk.usage

    async def finish_shielded(self) -> None:
        """``finish`` from a task being cancelled: shielded so its Redis calls complete."""
        with anyio.CancelScope(shield=True):
            await self.finish()

    async def finish(self) -> None:
        """Settle the reservation, record usage, count metrics — exactly once."""
        if self.finished:
            return
        self.finished = True
        now = time.perf_counter()
        usage = self.billed()
        billed_total = usage.prompt_tokens + usage.completion_tokens
        cost = self.admission.cost_micros(
            usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens
        )
        ttft_ms = (
            (self.first_token_at - self.started) * 1000 if self.first_token_at is not None else None
        )
        event = UsageEvent(
            request_id=self.request_id,
            key_id=self.key.id,
            model=self.public_model,
            deployment=self.deployment.name if self.deployment else None,
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens,
            cost_micros=cost,
            team_id=self.admission.team_id,
            status=self.status,  # type: ignore[arg-type]
            finish_reason=self.finish_reason if self.status == "ok" else None,
            latency_ms=(now - self.started) * 1000,
            ttft_ms=ttft_ms,
            started_at=time.time() - (now - self.started),
            finished_at=time.time(),
        )
        services = self.services
        try:
            pipe = services.redis.pipeline(transaction=False)
            pipe.execute_command(
                *services.limiter.settle_command(self.admission, billed_total, cost)
            )
            services.recorder.record_in(pipe, event)
            settled, recorded = await pipe.execute(raise_on_error=False)
            if isinstance(recorded, Exception):
                logger.error("usage of %s not recorded: %s", self.request_id, recorded)
            if isinstance(settled, Exception):
                # The settle script was forgotten (Redis restart): load it, settle again.
                await services.limiter.settle(self.admission, billed_total, cost)
        except RedisError:
            logger.exception("could not settle %s or record its usage", self.request_id)
        metrics = model_metrics(self.public_model)
        metrics.requests(self.status).inc()
        metrics.prompt_tokens.inc(usage.prompt_tokens)
        metrics.completion_tokens.inc(usage.completion_tokens)
        if ttft_ms is not None:
            metrics.time_to_first_token.observe(ttft_ms / 1000)
        if self.span.is_recording():
            self.span.set_attributes(
                genai_response_attributes(
                    self.response_id,
                    self.finish_reason,
                    usage.prompt_tokens,
                    usage.completion_tokens,
                )
            )
            if self.deployment is not None:
                # Known only now: the deployment that served ("openai" for HTTP upstreams).
                provider = "openai" if self.deployment.kind == "openai" else "sluicegate"
                self.span.set_attribute("gen_ai.provider.name", provider)
            if self.status != "ok":
                self.span.set_attribute("error.type", self.status)
        self.span.end()


def _public_error(exc: ProviderError, param: str) -> OpenAIError:
    if exc.code == "context_length_exceeded":
        return ContextLengthExceeded(exc.message, param=param)
    if exc.status_code == 400:
        return InvalidRequest(exc.message)
    if exc.status_code == 503:
        return ServiceUnavailable(exc.message)
    return UpstreamError(exc.message)


def _with_headers(exc: OpenAIError, headers: dict[str, str]) -> OpenAIError:
    for name, value in headers.items():
        exc.headers.setdefault(name, value)
    return exc


async def _admit(
    request: Request[Any, Any, Any],
    body: ChatCompletionRequest | CompletionRequest,
    *,
    chat: bool,
) -> tuple[Call, GenerationRequest]:
    services: Services = request.app.state.services
    state = request.scope["state"]
    key: ApiKeyRecord = state["api_key"]
    request_id = state["request_id"]
    started = state["started"]
    # One span for auth + admission, begun when the guard began authenticating.
    parent = child_context(state.get("server_span"))
    admission_span = tracer().start_span(
        "gateway.auth_and_admission", context=parent, start_time=state["auth_started_ns"]
    )
    try:
        body.check()
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
        sampling = body.sampling(services.settings.default_max_tokens if chat else 16)
        prompt_estimate = body.prompt_token_estimate()
        try:
            admission = await services.limiter.admit(
                key,
                request_id,
                prompt_estimate + sampling.max_tokens,
                model=route.name,
                prompt_tokens=prompt_estimate,
            )
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

    operation = "chat" if chat else "text_completion"
    span = tracer().start_span(f"{operation} {route.name}", context=parent, kind=SpanKind.CLIENT)
    if span.is_recording():
        span.set_attributes(
            genai_request_attributes(
                operation, "sluicegate", route.name, sampling.max_tokens, sampling.temperature
            )
        )
        if services.settings.otel_capture_content:
            content = body.messages if isinstance(body, ChatCompletionRequest) else body.prompt
            span.set_attribute("gen_ai.input.messages", encode(content).decode())
    with trace.use_span(span, end_on_exit=False):
        traceparent = current_traceparent()
    prefix = "chatcmpl-" if chat else "cmpl-"
    call = Call(
        services=services,
        key=key,
        route=route,
        admission=admission,
        request_id=request_id,
        response_id=prefix + request_id,
        created=int(time.time()),
        public_model=body.model,
        prompt_estimate=prompt_estimate,
        include_usage=body.include_usage,
        started=started,
        span=span,
    )
    settings = services.settings
    generation = GenerationRequest(
        request_id=request_id,
        model=route.name,
        sampling=sampling,
        messages=body.chat_messages() if isinstance(body, ChatCompletionRequest) else None,
        prompt=body.single_prompt() if isinstance(body, CompletionRequest) else None,
        deadline=time.time() + settings.request_timeout_s,
        traceparent=traceparent,
        user=body.user,
    )
    return call, generation


async def _complete(call: Call, generation: GenerationRequest, *, chat: bool) -> Response[bytes]:
    services = call.services
    call.generation_started = time.perf_counter()
    try:
        call.deployment, result = await services.router.complete(call.route, generation)
    except ProviderError as exc:
        call.status = "error"
        await call.finish()
        raise _with_headers(
            _public_error(exc, "messages" if chat else "prompt"), call.admission.headers
        ) from None
    except OpenAIError as exc:
        call.status = "error"
        await call.finish()
        raise _with_headers(exc, call.admission.headers) from None
    except BaseException:
        call.status = "cancelled"
        await call.finish_shielded()
        raise
    generated = time.perf_counter()
    call.first_token_at = generated
    call.delivered_tokens = result.num_tokens
    call.finish_reason = result.finish_reason or "stop"
    # An upstream that reports no usage is billed by the same estimate as prompts (chars/3).
    call.usage = result.usage or Usage(
        call.prompt_estimate, result.num_tokens or math.ceil(len(result.text) / 3)
    )
    call.status = "ok"
    usage = UsageOut.of(call.usage.prompt_tokens, call.usage.completion_tokens)
    body: ChatCompletion | TextCompletion
    if chat:
        body = ChatCompletion(
            id=call.response_id,
            created=call.created,
            model=call.public_model,
            choices=[
                ChatChoice(0, AssistantMessage("assistant", result.text), None, call.finish_reason)
            ],
            usage=usage,
        )
    else:
        body = TextCompletion(
            id=call.response_id,
            created=call.created,
            model=call.public_model,
            choices=[TextChoice(0, result.text, None, call.finish_reason)],
            usage=usage,
        )
    content = encode(body)
    await call.finish()
    ADDED_LATENCY.observe(
        (call.generation_started - call.started) + (time.perf_counter() - generated)
    )
    return Response(content, status_code=200, media_type=JSON, headers=call.admission.headers)


def _chunk(call: Call, *, chat: bool, text: str | None, role: bool, finish: str | None) -> bytes:
    if chat:
        delta = ChunkDelta(role="assistant" if role else None, content=text)
        chunk: ChatCompletionChunk | TextCompletion = ChatCompletionChunk(
            id=call.response_id,
            created=call.created,
            model=call.public_model,
            choices=[ChunkChoice(0, delta, None, finish)],
        )
    else:
        chunk = TextCompletion(
            id=call.response_id,
            created=call.created,
            model=call.public_model,
            choices=[TextChoice(0, text or "", None, finish)],
        )
    return sse(chunk)


def _usage_chunk(call: Call, *, chat: bool) -> bytes:
    usage = call.billed()
    usage_out = UsageOut.of(usage.prompt_tokens, usage.completion_tokens)
    if chat:
        return sse(
            ChatCompletionChunk(
                id=call.response_id,
                created=call.created,
                model=call.public_model,
                choices=[],
                usage=usage_out,
            )
        )
    return sse(
        TextCompletion(
            id=call.response_id,
            created=call.created,
            model=call.public_model,
            choices=[],
            usage=usage_out,
        )
    )


async def _events(
    call: Call, chunks: AsyncIterator[GenerationChunk], first: GenerationChunk, *, chat: bool
) -> AsyncIterator[bytes]:
    """SSE bytes; cancelled mid-way when the client disconnects (``finish`` bills that)."""
    if chat:
        yield _chunk(call, chat=True, text="", role=True, finish=None)
    chunk: GenerationChunk | None = first
    try:
        while chunk is not None:
            if chunk.text:
                yield _chunk(call, chat=chat, text=chunk.text, role=False, finish=None)
            if chunk.finish_reason:
                break
            chunk = await anext(chunks, None)
            if chunk is not None:
                call.chunk_received(chunk)
    except ProviderError as exc:
        call.status = "error"
        if exc.usage is not None:
            call.usage = exc.usage
        yield (
            b"data: "
            + encode(_public_error(exc, "messages" if chat else "prompt").body())
            + b"\n\n"
        )
        return
    except Exception:
        # Whatever broke, the client gets OpenAI's error event and the request is settled.
        logger.exception("stream %s failed", call.request_id)
        call.status = "error"
        failure = UpstreamError("The server had an error while streaming the response.")
        failure.error_type = "server_error"
        yield b"data: " + encode(failure.body()) + b"\n\n"
        return
    call.status = "ok"
    call.finish_reason = call.finish_reason or "stop"
    if call.usage is None:
        call.usage = Usage(call.prompt_tokens or call.prompt_estimate, call.delivered_tokens)
    yield _chunk(call, chat=chat, text=None if chat else "", role=False, finish=call.finish_reason)
    if call.include_usage:
        yield _usage_chunk(call, chat=chat)
    yield SSE_DONE


async def _stream(call: Call, generation: GenerationRequest, *, chat: bool) -> Stream:
    services = call.services
    call.generation_started = time.perf_counter()
    stream = services.router.stream(call.route, generation)
    chunks = aiter(stream)
    try:
        # The first chunk is awaited before answering, so failing to start is an HTTP error
        # (with fallback inside the router), not a 200 with an error event.
        first = await anext(chunks)
    except ProviderError as exc:
        call.deployment = stream.deployment
        call.status = "error"
        await stream.aclose()
        await call.finish()
        raise _with_headers(
            _public_error(exc, "messages" if chat else "prompt"), call.admission.headers
        ) from None
    except (OpenAIError, StopAsyncIteration) as exc:
        call.status = "error"
        await stream.aclose()
        await call.finish()
        if isinstance(exc, OpenAIError):
            raise _with_headers(exc, call.admission.headers) from None
        raise _with_headers(
            UpstreamError("The deployment ended the stream without an answer."),
            call.admission.headers,
        ) from None
    except BaseException:
        with anyio.CancelScope(shield=True):
            await stream.aclose()
        await call.finish_shielded()
        raise
    call.deployment = stream.deployment
    call.chunk_received(first)
    ADDED_LATENCY.observe(call.generation_started - call.started)
    events = _events(call, chunks, first, chat=chat)

    async def close() -> None:
        # Runs after the response, also when the client went away: closing the generators
        # cancels the upstream call; finish bills what was delivered.
        await events.aclose()
        await stream.aclose()
        await call.finish()

    return Stream(
        events,
        media_type="text/event-stream",
        headers={**SSE_HEADERS, **call.admission.headers},
        background=BackgroundTask(close),
    )


async def _serve(
    request: Request[Any, Any, Any],
    body: ChatCompletionRequest | CompletionRequest,
    *,
    chat: bool,
) -> Response[Any]:
    call, generation = await _admit(request, body, chat=chat)
    if body.stream:
        return await _stream(call, generation, chat=chat)
    return await _complete(call, generation, chat=chat)


class OpenAIController(Controller):
    path = "/v1"
    guards = (authenticate,)
    tags = ("openai",)

    @post("/chat/completions", status_code=200, summary="Create a chat completion")
    async def chat_completions(
        self, request: Request[Any, Any, Any], data: JSONBody[ChatCompletionRequest]
    ) -> Response[Any]:
        return await _serve(request, data, chat=True)

    @post("/completions", status_code=200, summary="Create a text completion")
    async def completions(
        self, request: Request[Any, Any, Any], data: JSONBody[CompletionRequest]
    ) -> Response[Any]:
        return await _serve(request, data, chat=False)

    @get("/models", summary="List the models this key may use")
    async def models(self, request: Request[Any, Any, Any]) -> Response[bytes]:
        services: Services = request.app.state.services
        key: ApiKeyRecord = request.scope["state"]["api_key"]
        cards = [
            ModelCard(id=route.name, created=services.started_at, owned_by="sluicegate")
            for route in await services.router.live_routes()
            if key.allows_model(route.name) or any(key.allows_model(a) for a in route.aliases)
        ]
        return Response(encode(ModelList(data=cards)), media_type=JSON)

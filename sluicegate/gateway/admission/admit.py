"""Admission: from a controller's canonical ``ChatRequest`` to an admitted ``Call``.

The ``authenticate`` guard found the key (in-process cache, no database once cached) before
the body was read. ``admit`` resolves the model, checks the key may use it, asks the
deployments whether they can honour the request, drafts the request's lease (``sluicegate.gateway.leases.lease``)
and books every limit of the key in one Redis call, which also stores that lease. The returned
``Call`` owns the reservation from then on: it settles it, whatever the request's end.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Coroutine
from typing import Any

from litestar import Request
from opentelemetry.context import Context
from opentelemetry.trace import INVALID_SPAN, Span
from redis.exceptions import RedisError

from sluicegate.gateway.call.call import Call
from sluicegate.gateway.call.spans import start_admission_span, start_generation_span
from sluicegate.gateway.canonical import ChatRequest
from sluicegate.gateway.errors import (
    InvalidRequest,
    ModelNotFound,
    OpenAIError,
    PermissionDenied,
    ServiceUnavailable,
)
from sluicegate.gateway.http.busy_poll import poll_while
from sluicegate.gateway.keys.records import ApiKeyRecord
from sluicegate.gateway.providers.base import ProviderError
from sluicegate.gateway.routing.adapters import adapter_route
from sluicegate.gateway.routing.router import ModelRoute
from sluicegate.gateway.services import Services
from sluicegate.gateway.telemetry import SPECULATIVE_DISPATCHES, child_context

TEXT_COMPLETION_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for text completions."""
_TOKEN_OVERHEAD_PER_MESSAGE = 4
"""Chat templates wrap every message in a few special tokens."""
_SERVES = {"chat": "chat or text completions", "embeddings": "embeddings"}
_ADMITTED = SPECULATIVE_DISPATCHES.labels("admitted")
_REFUSED = SPECULATIVE_DISPATCHES.labels("refused")


def prompt_token_estimate(request: ChatRequest) -> int:
    """Admission's guess of the prompt's tokens (chars / 3), before any tokenizer saw it."""
    if request.messages is not None:
        chars = sum(len(m.text()) for m in request.messages)
        return math.ceil(chars / 3) + _TOKEN_OVERHEAD_PER_MESSAGE * len(request.messages)
    prompt = request.prompt
    return len(prompt) if isinstance(prompt, list) else math.ceil(len(prompt or "") / 3)


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


async def _adapter_route(
    services: Services, key: ApiKeyRecord, body: ChatRequest
) -> ModelRoute | None:
    """The route of the LoRA adapter ``body.model`` names, with ``body.lora`` set; None when it
    names none this key may call (another team's adapter, or one its allow-list leaves out,
    reads exactly like an unknown model)."""
    adapters = services.adapters
    adapter = await adapters.find(body.model) if adapters is not None else None
    if adapter is None or not adapter.visible_to(key.team_id):
        return None
    if not (key.allows_model(body.model) or key.allows_model(adapter.model_name)):
        return None
    base = await services.router.resolve(adapter.base_model)
    route = adapter_route(body.model, adapter, base) if base is not None else None
    if route is None or not route.deployments:
        raise ServiceUnavailable(
            f"No engine worker is serving model '{adapter.base_model}', the base model of "
            f"'{body.model}', right now."
        )
    body.lora = adapter.wire()
    return route


def _check_output_cap(route: ModelRoute, body: ChatRequest, mode: str) -> None:
    """The 400 for an output cap no deployment can honour: below one token (the schemas refuse
    it already; a negative reservation would credit the key's budget), or beyond the largest
    ``context_window`` of the model's deployments when every one declares its window and no
    context-window fallback could take the request instead."""
    cap, n, param = body.sampling.max_tokens, body.sampling.n, body.max_tokens_param
    if cap is None:
        return
    if cap < 1:
        raise InvalidRequest(f"Invalid value for '{param}': {cap} is below 1.", param=param)
    if n < 1:
        raise InvalidRequest(f"Invalid value for 'n': {n} is below 1.", param="n")
    windows = [d.context_window for d in route.deployments if d.mode == mode]
    if windows and all(windows) and not route.context_window_fallbacks and cap > max(windows):
        raise InvalidRequest(
            f"Invalid value for '{param}': {cap} is more than this model's context window "
            f"of {max(windows)} tokens.",
            param=param,
        )


async def admit(
    request: Request[Any, Any, Any],
    body: ChatRequest,
    *,
    operation: str,
    id_prefix: str,
    mode: str = "chat",
    early: Callable[[ModelRoute, ChatRequest], Coroutine[Any, Any, Any]] | None = None,
) -> Call:
    """Resolve, authorise and book ``body``; the returned call owns the reservation.

    ``early`` is how the call fetches its whole answer (the router's ``complete`` or
    ``embed``): when the key's headroom allows, it starts while the admission is in Redis
    (``sluicegate.gateway.admission.speculation``) and the call takes its result, or it is cancelled if admission
    refuses."""
    services: Services = request.app.state.services
    state = request.scope["state"]
    key: ApiKeyRecord = state["api_key"]
    request_id = state["request_id"]
    # One span for auth + admission, begun when the guard began authenticating. Without
    # tracing no span is made at all (even a no-op one costs a context and a propagation).
    # The guard made the server span when, and only when, tracing is on: asking again would
    # cost another look at the environment.
    server_span = state.get("server_span")
    tracing = server_span is not None
    parent = child_context(server_span)
    admission_span = (
        start_admission_span(parent, state["auth_started_ns"]) if tracing else INVALID_SPAN
    )
    chat = body.messages is not None
    span: Span = INVALID_SPAN
    prefetch: asyncio.Task[Any] | None = None
    generation_started = 0.0
    try:
        route = await services.router.resolve(body.model)
        if route is None:
            route = await _adapter_route(services, key, body)
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
            _check_output_cap(route, body, mode)
            # Without a cap from the client, reserve the default cap; settling corrects it.
            max_tokens = body.sampling.max_tokens or (
                services.settings.default_max_tokens if chat else TEXT_COMPLETION_MAX_TOKENS
            )
        prompt_estimate = prompt_token_estimate(body)
        body.request_id = request_id
        body.deadline = time.time() + services.settings.request_timeout_s
        limiter = services.limiter
        completion = max_tokens * body.sampling.n
        tokens = prompt_estimate + completion
        try:
            priced = await limiter.worst_case(route.name, prompt_estimate, completion)
            if early is not None and limiter.may_dispatch_early(key.id, tokens, priced[1]):
                if tracing:
                    span = _generation_span(services, parent, body, operation, route, max_tokens)
                generation_started = time.perf_counter()
                # Its first step runs once the admission script is on its way to Redis.
                prefetch = asyncio.ensure_future(early(route, body))
                poll_while(prefetch, services.settings.busy_poll_us / 1e6)
            leases, draft = services.leases, None
            if leases is not None:
                # The admission script stores the lease (sluicegate.gateway.leases.lease): no round trip of its own.
                draft = await leases.draft(
                    key,
                    model=body.model,
                    adapter=route.adapter,
                    prompt_estimate=prompt_estimate,
                    started_at=time.time() - (time.perf_counter() - state["started"]),
                    max_completion=completion,
                )
            admission = await limiter.admit(
                key,
                request_id,
                tokens,
                model=route.name,
                prompt_tokens=prompt_estimate,
                lease=draft,
                priced=priced,
            )
            if leases is not None and draft is not None:
                await leases.opened(draft, admission)
        except RedisError as exc:
            raise ServiceUnavailable(
                "Rate limiting is unavailable (Redis unreachable); try again shortly."
            ) from exc
        if admission_span.is_recording():
            admission_span.set_attribute("sluicegate.key_id", key.id)
    except BaseException as exc:
        if isinstance(exc, OpenAIError) and admission_span.is_recording():
            admission_span.set_attribute("error.type", exc.code or exc.error_type)
        if prefetch is not None:
            _discard(prefetch)
            _REFUSED.inc()
            if span.is_recording():
                span.set_attribute("error.type", "refused")
            span.end()
        raise
    finally:
        admission_span.end()

    if prefetch is not None:
        _ADMITTED.inc()
    elif tracing:
        span = _generation_span(services, parent, body, operation, route, max_tokens)
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
        prefetched=prefetch,
        generation_started=generation_started,
        adapter=route.adapter,
    )


def _generation_span(
    services: Services,
    parent: Context | None,
    body: ChatRequest,
    operation: str,
    route: ModelRoute,
    max_tokens: int,
) -> Span:
    return start_generation_span(
        parent,
        body,
        operation=operation,
        model=route.name,
        max_tokens=max_tokens,
        capture_content=services.settings.otel_capture_content,
    )


def _discard(prefetch: asyncio.Task[Any]) -> None:
    """Cancel a speculative fetch whose request was not admitted; its outcome is dropped."""
    prefetch.cancel()
    prefetch.add_done_callback(lambda task: task.cancelled() or task.exception())

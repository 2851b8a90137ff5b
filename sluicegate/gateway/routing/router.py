"""Public model names -> deployments: selection, and the one fallback loop.

Routes come from the routing YAML (``config.py``) or, without one, from the engine workers'
heartbeats (``discovery.py``); a streamed answer is a ``Generation`` (``stream.py``). Selection is weighted least-outstanding: the deployment
with the fewest requests in flight per unit of weight first (ties broken at random); a model
with ``spill_over`` keeps its listed order instead, and moves an engine deployment behind the
others while its workers say a new request would queue longer than ``max_queue_ms``.

``Router.serve`` is the one loop every request goes through, whole or streamed, until the
first token: a 429, 5xx or connect error retries the same deployment after a backoff (its
``retry-after`` when it sent one, unless longer than ``max_retry_after_s``), then moves to
the model's next deployment, then to the models named in ``fallbacks``; a prompt too long for
a deployment (its ``context_window``, or a context-length error) moves to the models in
``context_window_fallbacks``. ``cooldown_failures`` failures in a row take a deployment out
for ``cooldown_s`` (per replica), so a dead upstream gets a fast 503 instead of every client
waiting for its timeout; a failure its provider calls momentary (an engine's Redis blip) is
retried and moved past like the others but does not count.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml
from redis.asyncio import Redis

from sluicegate.gateway.call.response_builder import collect
from sluicegate.gateway.canonical import ChatRequest, Response, Usage
from sluicegate.gateway.errors import ServiceUnavailable
from sluicegate.gateway.providers.base import ProviderError
from sluicegate.gateway.providers.hosted import Sessions
from sluicegate.gateway.routing.config import ConfigError, Deployment, ModelRoute, RouteFactory
from sluicegate.gateway.routing.counting import Counted, count_on
from sluicegate.gateway.routing.discovery import Discovery
from sluicegate.gateway.routing.stream import Generation
from sluicegate.gateway.settings import Settings
from sluicegate.gateway.telemetry import UPSTREAM_ERRORS

__all__ = ["ConfigError", "Deployment", "Generation", "ModelRoute", "Router"]

T = TypeVar("T")
_PROMPT_CHARS_PER_TOKEN = 3


def prompt_estimate(request: ChatRequest) -> int:
    """A prompt's tokens as admission guesses them (chars / 3), for context-window checks."""
    if request.messages is not None:
        return math.ceil(sum(len(m.text()) for m in request.messages) / _PROMPT_CHARS_PER_TOKEN)
    prompt = request.prompt
    if isinstance(prompt, list):
        return len(prompt)
    return math.ceil(len(prompt or "") / _PROMPT_CHARS_PER_TOKEN)


class Router:
    def __init__(
        self,
        settings: Settings,
        redis: Redis,
        routes: list[ModelRoute] | None = None,
    ) -> None:
        self._settings = settings
        self._redis = redis
        self.sessions = Sessions()
        """The upstream providers' aiohttp session (no cap on its connections)."""
        self.discovering = routes is None
        self._routes: dict[str, ModelRoute] = {}
        self._names: dict[str, ModelRoute] = {}
        self._factory = RouteFactory(settings, redis, self.sessions)
        self._discovery = Discovery(redis, self._add_engine_model)
        for route in routes or []:
            self._add(route)

    @classmethod
    def from_settings(cls, settings: Settings, redis: Redis) -> Router:
        router = cls(settings, redis, routes=[] if settings.config else None)
        if settings.config:
            config = yaml.safe_load(Path(settings.config).read_text()) or {}
            for route in router.routes_from_config(config):
                router._add(route)
        return router

    # ---- configuration -----------------------------------------------------------------------

    def routes_from_config(self, config: dict[str, Any]) -> list[ModelRoute]:
        return self._factory.routes(config, set(self._names))

    def make_deployment(self, spec: dict[str, Any]) -> Deployment:
        return self._factory.deployment(spec)

    def _add_engine_model(self, model: str) -> None:
        if model not in self._routes:
            provider = self._factory.engine_provider(model)
            deployment = Deployment(provider, kind="engine", model=model)
            self._add(ModelRoute(model, deployments=[deployment]))

    def _add(self, route: ModelRoute) -> None:
        self._routes[route.name] = route
        for name in [route.name, *route.aliases]:
            self._names[name] = route

    # ---- lookup ------------------------------------------------------------------------------

    @property
    def _refreshed_at(self) -> float:
        return self._discovery.refreshed_at

    @_refreshed_at.setter
    def _refreshed_at(self, value: float) -> None:
        self._discovery.refreshed_at = value

    async def load(self) -> None:
        """Loads the routing table now (discovery mode reads the workers' registry), raising
        when it cannot be read: the readiness probe's routing check."""
        if self.discovering:
            await self._discovery.refresh(force=True)

    async def resolve(self, name: str) -> ModelRoute | None:
        route = self._names.get(name)
        if route is None and self.discovering:
            await self._discovery.refresh()
            route = self._names.get(name)
        return route

    async def live_routes(self) -> list[ModelRoute]:
        """Models with at least one deployment that could serve now."""
        if self.discovering:
            await self._discovery.refresh()
        now = time.monotonic()
        live = []
        for route in self._routes.values():
            for deployment in route.deployments:
                if not deployment.cooling(now) and await deployment.provider.is_available():
                    live.append(route)
                    break
        return live

    # ---- selection ---------------------------------------------------------------------------

    async def candidates(
        self, route: ModelRoute, request: ChatRequest | None = None, mode: str = "chat"
    ) -> list[Deployment]:
        """Deployments to try, best first: serving ``mode``, able to honour ``request`` (when
        given) and hold its prompt, not cooling down, available, least loaded (or in listed
        order, spilling over, for a spill-over model)."""
        now = time.monotonic()
        estimate: int | None = None
        ready = []
        for d in route.deployments:
            if d.mode != mode or d.cooling(now):
                continue
            if d.context_window:
                if estimate is None:
                    estimate = prompt_estimate(request) if request is not None else 0
                if estimate > d.context_window:
                    continue
            if request is None or d.provider.unsupported(request) is None:
                ready.append(d)
        if route.spill_over_ms is None:
            if len(ready) > 1:
                random.shuffle(ready)
                ready.sort(key=lambda d: (d.outstanding + 1) / d.weight)
        else:
            ready = await self._spill_order(ready, route.spill_over_ms)
        return [d for d in ready if await d.provider.is_available()]

    async def _spill_order(self, ready: list[Deployment], max_queue_ms: float) -> list[Deployment]:
        """Listed order, with engine deployments whose queue is too long moved last."""
        short, long = [], []
        for deployment in ready:
            queue_ms = getattr(deployment.provider, "queue_ms", None)
            waiting = await queue_ms() if queue_ms is not None else 0.0
            (long if waiting > max_queue_ms else short).append(deployment)
        return short + long

    def _too_long(self, route: ModelRoute, request: ChatRequest) -> bool:
        windows = [d.context_window for d in route.deployments]
        return bool(windows) and all(windows) and prompt_estimate(request) > max(windows)

    def _chain(self, route: ModelRoute, request: ChatRequest) -> list[ModelRoute]:
        """The models to try in order: this one (unless the prompt is too long for all of
        its deployments), then its fallbacks."""
        chain = [] if self._too_long(route, request) else [route]
        names = route.context_window_fallbacks if not chain else route.fallbacks
        for name in names:
            other = self._names.get(name)
            if other is not None and other not in chain:
                chain.append(other)
        return chain

    # ---- the fallback loop -------------------------------------------------------------------

    def _retry_delay(self, attempt: int, error: ProviderError) -> float | None:
        """How long to wait before retrying the same deployment; None: move on."""
        if attempt >= self._settings.upstream_retries:
            return None
        if error.retry_after_s is not None:
            if error.retry_after_s > self._settings.max_retry_after_s:
                return None
            return error.retry_after_s
        return self._settings.retry_backoff_s * (2**attempt)

    async def serve(
        self,
        route: ModelRoute,
        request: ChatRequest,
        start: Callable[[Deployment], Awaitable[T]],
        *,
        hold: bool = False,
        mode: str = "chat",
    ) -> tuple[Deployment, T]:
        """``start`` on deployments in fallback order until one succeeds. With ``hold`` the
        winner's ``outstanding`` stays counted (a stream still running); else it is released."""
        last_error: ProviderError | None = None
        chain = self._chain(route, request)
        tried: set[int] = set()
        for position, model_route in enumerate(chain):
            for deployment in await self.candidates(model_route, request, mode):
                if id(deployment) in tried:
                    continue
                tried.add(id(deployment))
                attempt = 0
                while True:
                    deployment.outstanding += 1
                    try:
                        result = await start(deployment)
                    except ProviderError as exc:
                        deployment.outstanding -= 1
                        if exc.code == "context_length_exceeded" and position == 0:
                            return await self._context_fallback(route, request, start, exc, hold)
                        if not exc.retryable:
                            raise
                        self.failed(deployment, cool=exc.counts_toward_cooldown)
                        last_error = exc
                        delay = self._retry_delay(attempt, exc)
                        if delay is None or deployment.cooling():
                            break
                        attempt += 1
                        await asyncio.sleep(delay)
                        continue
                    except BaseException:
                        deployment.outstanding -= 1
                        raise
                    if not hold:
                        deployment.outstanding -= 1
                    self.succeeded(deployment)
                    return deployment, result
        raise self.exhausted(route, last_error)

    async def _context_fallback(
        self,
        route: ModelRoute,
        request: ChatRequest,
        start: Callable[[Deployment], Awaitable[T]],
        error: ProviderError,
        hold: bool,
    ) -> tuple[Deployment, T]:
        others = [self._names[n] for n in route.context_window_fallbacks if n in self._names]
        if not others:
            raise error
        bigger = ModelRoute(route.name, deployments=[], fallbacks=[r.name for r in others])
        return await self.serve(bigger, request, start, hold=hold)

    # ---- outcomes ----------------------------------------------------------------------------

    def failed(self, deployment: Deployment, cool: bool = True) -> None:
        UPSTREAM_ERRORS.labels(deployment.name).inc()
        if not cool:
            return
        deployment.failures += 1
        if deployment.failures >= self._settings.cooldown_failures:
            deployment.failures = 0
            deployment.cooldown_until = time.monotonic() + self._settings.cooldown_s

    def succeeded(self, deployment: Deployment) -> None:
        deployment.failures = 0

    def exhausted(self, route: ModelRoute, last_error: ProviderError | None) -> Exception:
        if last_error is not None:
            return ServiceUnavailable(
                f"No deployment of model '{route.name}' could serve the request "
                f"(last error: {last_error.message})."
            )
        return ServiceUnavailable(
            f"No deployment of model '{route.name}' is available right now; try again shortly."
        )

    # ---- serving -----------------------------------------------------------------------------

    def stream(self, route: ModelRoute, request: ChatRequest) -> Generation:
        return Generation(self.serve, route, request)

    async def complete(
        self, route: ModelRoute, request: ChatRequest
    ) -> tuple[Deployment, Response]:
        """The whole answer, with fallback (nothing reached the client yet)."""

        async def start(deployment: Deployment) -> Response:
            complete = getattr(deployment.provider, "complete", None)
            if complete is not None:
                result: Response = await complete(request)
                return result
            return await collect(deployment.provider, request)

        return await self.serve(route, request, start)

    async def count_tokens(
        self, route: ModelRoute, request: ChatRequest
    ) -> tuple[Deployment, Counted]:
        """The prompt's tokens as a deployment that would serve it counts them, with fallback
        (counting.py: its own count, else a billed one-token generation)."""

        async def start(deployment: Deployment) -> Counted:
            return await count_on(deployment.provider, request)

        return await self.serve(route, request, start)

    async def embed(
        self, route: ModelRoute, request: ChatRequest
    ) -> tuple[Deployment, tuple[dict[str, Any], Usage | None]]:
        """Embeddings of ``request.passthrough`` (the client's body), with fallback."""

        async def start(deployment: Deployment) -> tuple[dict[str, Any], Usage | None]:
            body = request.passthrough or {}
            result: tuple[dict[str, Any], Usage | None] = await deployment.provider.embed(  # type: ignore[attr-defined]
                body, request.traceparent, request.deadline
            )
            return result

        return await self.serve(route, request, start, mode="embeddings")

    def describe(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [
            {
                "name": route.name,
                "aliases": list(route.aliases),
                "fallbacks": list(route.fallbacks),
                "context_window_fallbacks": list(route.context_window_fallbacks),
                "spill_over_ms": route.spill_over_ms,
                "deployments": [
                    {
                        "name": d.name,
                        "provider": d.kind,
                        "model": d.model,
                        "weight": d.weight,
                        "mode": d.mode,
                        "context_window": d.context_window,
                        "outstanding": d.outstanding,
                        "healthy": not d.cooling(now),
                        "cooldown_remaining_s": round(max(0.0, d.cooldown_until - now), 3),
                    }
                    for d in route.deployments
                ],
            }
            for route in self._routes.values()
        ]

    async def close(self) -> None:
        for route in self._routes.values():
            for deployment in route.deployments:
                await deployment.provider.close()
        await self.sessions.close()

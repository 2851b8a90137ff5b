"""Public model names -> deployments: selection, fallback and cooldowns.

The YAML file named by ``SLUICEGATE_CONFIG`` lists models, their aliases and deployments::

    models:
      - name: llama-3.1-8b
        aliases: [llama3]
        deployments:
          - provider: engine          # engine workers over Redis Streams
            model: llama-3.1-8b
          - provider: openai          # any OpenAI-compatible HTTP upstream
            base_url: http://127.0.0.1:9000/v1
            api_key_env: UPSTREAM_API_KEY
            model: gpt-4o-mini
            weight: 1
      - name: text-embedding-3-small
        deployments:
          - provider: openai
            mode: embeddings          # serves POST /v1/embeddings (default: chat)
            base_url: https://api.openai.com/v1
            api_key_env: OPENAI_API_KEY
            model: text-embedding-3-small

Without a file, the models are those of live engine workers (the model registry their
heartbeats stamp), so a single-machine ``sluicegate up`` needs no configuration.

Selection is weighted least-outstanding: the deployment with the fewest requests in flight per
unit of weight first (ties broken at random), the others as fallbacks. A connect error,
timeout or 5xx before the first token moves on to the next; ``cooldown_failures`` failures in
a row take a deployment out for ``cooldown_s`` — even the only one, so a dead upstream gets a
fast 503 instead of every client waiting for its timeout. Cooldown state is per replica.
"""

from __future__ import annotations

import importlib
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import yaml
from redis.asyncio import Redis

from engine.protocol import MODEL_REGISTRY
from gateway.canonical import ChatRequest, Chunk, Response, ResponseBuilder, Usage
from gateway.errors import ServiceUnavailable
from gateway.providers.base import Provider, ProviderError
from gateway.providers.openai import CONNECT_TIMEOUT_S, OpenAIProvider
from gateway.routing_config import HOSTED_KINDS, ConfigError, api_key, hosted_provider
from gateway.settings import Settings
from gateway.telemetry import UPSTREAM_ERRORS

T = TypeVar("T")

DISCOVERY_REFRESH_S = 1.0
DISCOVERY_WINDOW_S = 3600.0
"""A model whose workers last beat longer ago than this is not added (one added stays)."""


@dataclass(eq=False)
class Deployment:
    provider: Provider
    kind: str
    model: str
    weight: float = 1.0
    mode: str = "chat"
    """What it serves: ``chat`` (chat and text completions) or ``embeddings``."""
    outstanding: int = 0
    failures: int = 0
    cooldown_until: float = 0.0

    @property
    def name(self) -> str:
        return self.provider.name

    def cooling(self, now: float) -> bool:
        return now < self.cooldown_until


@dataclass(eq=False)
class ModelRoute:
    name: str
    aliases: list[str] = field(default_factory=list)
    deployments: list[Deployment] = field(default_factory=list)


class Generation:
    """One request's stream with fallback; ``deployment`` names who is serving it."""

    def __init__(self, router: Router, route: ModelRoute, request: ChatRequest) -> None:
        self._router = router
        self._route = route
        self._request = request
        self.deployment: Deployment | None = None
        self._iterator = self._run()

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self._iterator

    async def aclose(self) -> None:
        await self._iterator.aclose()

    async def _run(self) -> AsyncIterator[Chunk]:
        last_error: ProviderError | None = None
        for deployment in await self._router.candidates(self._route, self._request):
            self.deployment = deployment
            deployment.outstanding += 1
            chunks = deployment.provider.generate(self._request)
            try:
                try:
                    first = await anext(aiter(chunks))
                except ProviderError as exc:
                    if not exc.retryable:
                        raise
                    self._router.failed(deployment)
                    last_error = exc
                    continue
                except StopAsyncIteration:
                    self._router.failed(deployment)
                    last_error = ProviderError(f"{deployment.name} ended without an answer")
                    continue
                self._router.succeeded(deployment)
                yield first
                async for chunk in chunks:
                    yield chunk
                return
            except ProviderError as exc:
                if exc.retryable or exc.status_code >= 500:
                    UPSTREAM_ERRORS.labels(deployment.name).inc()
                raise
            finally:
                deployment.outstanding -= 1
                await chunks.aclose()  # type: ignore[attr-defined]
        raise self._router.exhausted(self._route, last_error)


class Router:
    def __init__(
        self,
        settings: Settings,
        redis: Redis,
        client: httpx.AsyncClient,
        routes: list[ModelRoute] | None = None,
    ) -> None:
        self._settings = settings
        self._redis = redis
        self.client = client
        self.discovering = routes is None
        self._routes: dict[str, ModelRoute] = {}
        self._names: dict[str, ModelRoute] = {}
        self._refreshed_at = 0.0
        self._pending_names: set[str] = set()
        for route in routes or []:
            self._add(route)

    @classmethod
    def from_settings(cls, settings: Settings, redis: Redis) -> Router:
        client = httpx.AsyncClient(
            timeout=httpx.Timeout(settings.first_token_timeout_s, connect=CONNECT_TIMEOUT_S),
            limits=httpx.Limits(max_connections=1000, max_keepalive_connections=200),
        )
        router = cls(settings, redis, client, routes=[] if settings.config else None)
        if settings.config:
            config = yaml.safe_load(Path(settings.config).read_text()) or {}
            for route in router.routes_from_config(config):
                router._add(route)
        return router

    # ---- configuration -----------------------------------------------------------------------

    def routes_from_config(self, config: dict[str, Any]) -> list[ModelRoute]:
        models = config.get("models")
        if not isinstance(models, list):
            raise ConfigError("the routing config needs a top-level 'models' list")
        routes = []
        for entry in models:
            if not isinstance(entry, dict) or not entry.get("name"):
                raise ConfigError(f"every model needs a name: {entry!r}")
            deployments = [self.make_deployment(d) for d in entry.get("deployments") or []]
            if not deployments:
                raise ConfigError(f"model {entry['name']!r} has no deployments")
            routes.append(ModelRoute(entry["name"], list(entry.get("aliases") or []), deployments))
        return routes

    def make_deployment(self, spec: dict[str, Any]) -> Deployment:
        kind = spec.get("provider")
        model = spec.get("model")
        if not model:
            raise ConfigError(f"deployment needs a model: {spec!r}")
        weight = float(spec.get("weight", 1.0))
        mode = spec.get("mode", "chat")
        if mode not in ("chat", "embeddings") or (mode == "embeddings" and kind != "openai"):
            raise ConfigError(
                f"deployment mode must be chat or embeddings (embeddings: provider openai): "
                f"{spec!r}"
            )
        if weight <= 0:
            raise ConfigError(f"deployment weight must be positive: {spec!r}")
        provider: Provider
        if kind == "openai":
            base_url = spec.get("base_url")
            if not base_url:
                raise ConfigError(f"openai deployment needs base_url: {spec!r}")
            provider = OpenAIProvider(
                name=spec.get("name") or self._unique_name(f"openai:{model}"),
                base_url=base_url,
                model=model,
                client=self.client,
                api_key=api_key(spec),
                read_timeout_s=self._settings.request_timeout_s,
            )
        elif kind == "engine":
            provider = self._engine_provider(model)
        elif kind in HOSTED_KINDS:
            name = spec.get("name") or self._unique_name(f"{kind}:{model}")
            timeout = self._settings.request_timeout_s
            provider = hosted_provider(kind, spec, name, self.client, timeout)
        else:
            kinds = ", ".join(("openai", "engine", *HOSTED_KINDS))
            raise ConfigError(f"unknown provider kind {kind!r} (expected one of {kinds})")
        return Deployment(provider=provider, kind=kind, model=model, weight=weight, mode=mode)

    def _unique_name(self, base: str) -> str:
        """A default deployment name: it labels metrics and shows in errors, so it names the
        model, never the upstream's URL; a second deployment of one model gets ``#2``."""
        taken = {d.name for route in self._routes.values() for d in route.deployments}
        taken |= self._pending_names
        name, n = base, 1
        while name in taken:
            n += 1
            name = f"{base}#{n}"
        self._pending_names.add(name)
        return name

    def _engine_provider(self, model: str) -> Provider:
        # Imported here so the HTTP-only gateway works without the transport module loaded.
        module = importlib.import_module("gateway.providers.engine")
        provider: Provider = module.EngineProvider(self._redis, self._settings, model=model)
        return provider

    def _add(self, route: ModelRoute) -> None:
        self._routes[route.name] = route
        for name in [route.name, *route.aliases]:
            self._names[name] = route

    # ---- lookup ------------------------------------------------------------------------------

    async def load(self) -> None:
        """Loads the routing table now (discovery mode reads the workers' registry), raising
        when it cannot be read: the readiness probe's routing check."""
        await self._refresh(force=True)

    async def _refresh(self, force: bool = False) -> None:
        """Discovery mode: one route per model that has a worker heartbeat."""
        now = time.monotonic()
        if not self.discovering or (not force and now - self._refreshed_at < DISCOVERY_REFRESH_S):
            return
        self._refreshed_at = now
        # Workers stamp their model in one sorted set each heartbeat: one read, no SCAN.
        since = time.time() - DISCOVERY_WINDOW_S
        models = {
            m.decode() if isinstance(m, bytes) else m
            for m in await self._redis.zrangebyscore(MODEL_REGISTRY, since, "+inf")
        }
        for model in sorted(models - self._routes.keys()):
            deployment = Deployment(self._engine_provider(model), kind="engine", model=model)
            self._add(ModelRoute(model, deployments=[deployment]))

    async def resolve(self, name: str) -> ModelRoute | None:
        route = self._names.get(name)
        if route is None and self.discovering:
            await self._refresh()
            route = self._names.get(name)
        return route

    async def live_routes(self) -> list[ModelRoute]:
        """Models with at least one deployment that could serve now."""
        await self._refresh()
        now = time.monotonic()
        live = []
        for route in self._routes.values():
            for deployment in route.deployments:
                if not deployment.cooling(now) and await deployment.provider.is_available():
                    live.append(route)
                    break
        return live

    async def candidates(
        self, route: ModelRoute, request: ChatRequest | None = None, mode: str = "chat"
    ) -> list[Deployment]:
        """Deployments to try, best first: serving ``mode``, able to honour ``request`` (when
        given), not cooling down, available, least loaded."""
        now = time.monotonic()
        ready = [
            d
            for d in route.deployments
            if d.mode == mode
            and not d.cooling(now)
            and (request is None or d.provider.unsupported(request) is None)
        ]
        random.shuffle(ready)
        ready.sort(key=lambda d: (d.outstanding + 1) / d.weight)
        return [d for d in ready if await d.provider.is_available()]

    # ---- outcomes ----------------------------------------------------------------------------

    def failed(self, deployment: Deployment) -> None:
        UPSTREAM_ERRORS.labels(deployment.name).inc()
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
        return Generation(self, route, request)

    async def complete(
        self, route: ModelRoute, request: ChatRequest
    ) -> tuple[Deployment, Response]:
        """The whole answer at once, with fallback (nothing reached the client yet)."""

        async def answer(deployment: Deployment) -> Response:
            complete = getattr(deployment.provider, "complete", None)
            if complete is not None:
                result: Response = await complete(request)
                return result
            return await _collect(deployment.provider, request)

        return await self._first_answer(route, request, "chat", answer)

    async def embed(
        self, route: ModelRoute, request: ChatRequest
    ) -> tuple[Deployment, tuple[dict[str, Any], Usage | None]]:
        """Embeddings of ``request.passthrough`` (the client's body), with fallback."""

        async def answer(deployment: Deployment) -> tuple[dict[str, Any], Usage | None]:
            body = request.passthrough or {}
            result: tuple[dict[str, Any], Usage | None] = await deployment.provider.embed(  # type: ignore[attr-defined]
                body, request.traceparent, request.deadline
            )
            return result

        return await self._first_answer(route, request, "embeddings", answer)

    async def _first_answer(
        self,
        route: ModelRoute,
        request: ChatRequest,
        mode: str,
        answer: Callable[[Deployment], Awaitable[T]],
    ) -> tuple[Deployment, T]:
        last_error: ProviderError | None = None
        for deployment in await self.candidates(route, request, mode):
            deployment.outstanding += 1
            try:
                result = await answer(deployment)
            except ProviderError as exc:
                if not exc.retryable:
                    raise
                self.failed(deployment)
                last_error = exc
                continue
            finally:
                deployment.outstanding -= 1
            self.succeeded(deployment)
            return deployment, result
        raise self.exhausted(route, last_error)

    def describe(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        return [
            {
                "name": route.name,
                "aliases": list(route.aliases),
                "deployments": [
                    {
                        "name": d.name,
                        "provider": d.kind,
                        "model": d.model,
                        "weight": d.weight,
                        "mode": d.mode,
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
        await self.client.aclose()


async def _collect(provider: Provider, request: ChatRequest) -> Response:
    """Fold a provider's stream into one response."""
    builder = ResponseBuilder()
    chunks = provider.generate(request)
    try:
        async for chunk in chunks:
            builder.add(chunk)
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]
    return builder.build()

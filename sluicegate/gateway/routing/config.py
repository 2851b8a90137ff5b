"""The routing YAML (``SLUICEGATE_CONFIG``) parsed into routes and deployments.

::

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
            context_window: 128000    # prompts estimated longer skip this deployment
        fallbacks: [claude-sonnet]    # after every deployment failed (retryable errors)
        context_window_fallbacks: [gemini-pro]   # when the prompt is too long for all of them
        spill_over: {max_queue_ms: 500}   # engine first; the next deployment while the
                                          # engine's queue would hold a request longer
      - name: text-embedding-3-small
        deployments:
          - provider: openai
            mode: embeddings          # serves POST /v1/embeddings (default: chat)
            base_url: https://api.openai.com/v1
            api_key_env: OPENAI_API_KEY
            model: text-embedding-3-small

Hosted APIs (``provider: anthropic | gemini | azure | bedrock``)::

    - provider: anthropic          # x-api-key from the named variable
      model: claude-sonnet-4-5
      api_key_env: ANTHROPIC_API_KEY
    - provider: gemini
      model: gemini-2.5-flash
      api_key_env: GEMINI_API_KEY
    - provider: azure              # a classic deployment (api-version) or, without
      endpoint: https://my-resource.openai.azure.com   # `deployment`, the v1 API
      deployment: gpt-4o-prod
      model: gpt-4o
      api_key_env: AZURE_OPENAI_API_KEY
    - provider: bedrock            # credentials from the standard AWS chain
      model: anthropic.claude-3-5-haiku-20241022-v1:0
      region: us-east-1

``base_url`` overrides a provider's public address (a proxy, or a test server). Keys are read
from the environment once, at load; ``api_key_env`` may not name a ``SLUICEGATE_*`` variable,
so a routing file can never send the gateway's own secrets (master key, database URL) upstream.
"""

from __future__ import annotations

import importlib
import os
import time
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

from sluicegate.gateway.providers.anthropic import AnthropicProvider
from sluicegate.gateway.providers.azure import DEFAULT_API_VERSION, AzureProvider
from sluicegate.gateway.providers.base import Provider
from sluicegate.gateway.providers.bedrock import BedrockProvider
from sluicegate.gateway.providers.gemini import GeminiProvider
from sluicegate.gateway.providers.hosted import Sessions
from sluicegate.gateway.providers.openai import OpenAIProvider
from sluicegate.gateway.settings import Settings

HOSTED_KINDS = ("anthropic", "gemini", "azure", "bedrock")


class ConfigError(ValueError):
    """The routing YAML is malformed."""


@dataclass(eq=False)
class Deployment:
    provider: Provider
    kind: str
    model: str
    weight: float = 1.0
    mode: str = "chat"
    """What it serves: ``chat`` (chat and text completions) or ``embeddings``."""
    context_window: int = 0
    """Prompt tokens this deployment takes at most (0 = not said)."""
    outstanding: int = 0
    failures: int = 0
    cooldown_until: float = 0.0

    @property
    def name(self) -> str:
        return self.provider.name

    def cooling(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) < self.cooldown_until


@dataclass(eq=False)
class ModelRoute:
    name: str
    aliases: list[str] = field(default_factory=list)
    deployments: list[Deployment] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)
    """Models to try, in order, once every deployment of this one failed."""
    context_window_fallbacks: list[str] = field(default_factory=list)
    """Models to try when the prompt is too long for this one."""
    spill_over_ms: float | None = None
    """Spill-over: deployments in their listed order, an engine one skipped while its
    workers' queue would hold a new request longer than this."""
    adapter: str | None = None
    """The LoRA adapter (``base:adapter``) this route runs on its base model's engines."""


def _names(entry: dict[str, Any], key: str) -> list[str]:
    value = entry.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"model {entry.get('name')!r}: {key} must be a list of model names")
    return list(value)


def route_options(entry: dict[str, Any]) -> dict[str, Any]:
    """A model entry's routing options besides its deployments."""
    options: dict[str, Any] = {
        "fallbacks": _names(entry, "fallbacks"),
        "context_window_fallbacks": _names(entry, "context_window_fallbacks"),
    }
    spill = entry.get("spill_over")
    if spill is not None:
        if not isinstance(spill, dict) or not isinstance(spill.get("max_queue_ms"), int | float):
            raise ConfigError(f"model {entry.get('name')!r}: spill_over needs {{max_queue_ms: N}}")
        options["spill_over_ms"] = float(spill["max_queue_ms"])
    return options


def api_key(spec: dict[str, Any]) -> str | None:
    name = spec.get("api_key_env")
    if not name:
        return None
    if not isinstance(name, str) or name.upper().startswith("SLUICEGATE_"):
        raise ConfigError(
            f"api_key_env may not name a SLUICEGATE_* variable (the gateway's own settings): "
            f"{name!r}"
        )
    return os.environ.get(name)


def hosted_provider(
    kind: str, spec: dict[str, Any], name: str, sessions: Sessions, read_timeout_s: float
) -> Provider:
    model = str(spec["model"])
    common: dict[str, Any] = {"name": name, "model": model, "sessions": sessions}
    common["read_timeout_s"] = read_timeout_s
    base_url = spec.get("base_url")
    if kind == "anthropic":
        extra = {"base_url": base_url} if base_url else {}
        return AnthropicProvider(api_key=api_key(spec), **common, **extra)
    if kind == "gemini":
        extra = {"base_url": base_url} if base_url else {}
        return GeminiProvider(api_key=api_key(spec), **common, **extra)
    if kind == "azure":
        endpoint = spec.get("endpoint") or base_url
        if not endpoint:
            raise ConfigError(f"azure deployment needs endpoint: {spec!r}")
        return AzureProvider(
            endpoint=endpoint,
            deployment=spec.get("deployment"),
            api_version=str(spec.get("api_version") or DEFAULT_API_VERSION),
            api_key=api_key(spec),
            **common,
        )
    if kind == "bedrock":
        return BedrockProvider(region=spec.get("region"), base_url=base_url, **common)
    raise ConfigError(f"unknown provider kind {kind!r}")


class RouteFactory:
    """Routes and deployments from the YAML's entries; default deployment names are unique."""

    def __init__(self, settings: Settings, redis: Redis, sessions: Sessions) -> None:
        self._settings = settings
        self._redis = redis
        self._sessions = sessions
        self._names: set[str] = set()

    def routes(self, config: dict[str, Any], known_models: set[str]) -> list[ModelRoute]:
        models = config.get("models")
        if not isinstance(models, list):
            raise ConfigError("the routing config needs a top-level 'models' list")
        routes = []
        for entry in models:
            if not isinstance(entry, dict) or not entry.get("name"):
                raise ConfigError(f"every model needs a name: {entry!r}")
            deployments = [self.deployment(d) for d in entry.get("deployments") or []]
            if not deployments:
                raise ConfigError(f"model {entry['name']!r} has no deployments")
            aliases = list(entry.get("aliases") or [])
            routes.append(ModelRoute(entry["name"], aliases, deployments, **route_options(entry)))
        names = {n for r in routes for n in [r.name, *r.aliases]} | known_models
        for route in routes:
            for other in route.fallbacks + route.context_window_fallbacks:
                if other not in names:
                    raise ConfigError(f"model {route.name!r} falls back to unknown {other!r}")
        return routes

    def deployment(self, spec: dict[str, Any]) -> Deployment:
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
        timeout = self._settings.request_timeout_s
        if kind == "openai":
            base_url = spec.get("base_url")
            if not base_url:
                raise ConfigError(f"openai deployment needs base_url: {spec!r}")
            provider = OpenAIProvider(
                name=spec.get("name") or self._unique_name(f"openai:{model}"),
                base_url=base_url,
                model=model,
                sessions=self._sessions,
                api_key=api_key(spec),
                read_timeout_s=timeout,
                first_token_timeout_s=self._settings.first_token_timeout_s,
                max_connections=_max_connections(spec),
            )
        elif kind == "engine":
            provider = self.engine_provider(model)
        elif kind in HOSTED_KINDS:
            name = spec.get("name") or self._unique_name(f"{kind}:{model}")
            provider = hosted_provider(kind, spec, name, self._sessions, timeout)
        else:
            kinds = ", ".join(("openai", "engine", *HOSTED_KINDS))
            raise ConfigError(f"unknown provider kind {kind!r} (expected one of {kinds})")
        self._names.add(provider.name)
        window = int(spec.get("context_window") or 0)
        return Deployment(provider, kind, model, weight=weight, mode=mode, context_window=window)

    def _unique_name(self, base: str) -> str:
        """A default deployment name: it labels metrics and shows in errors, so it names the
        model, never the upstream's URL; a second deployment of one model gets ``#2``."""
        name, n = base, 1
        while name in self._names:
            n += 1
            name = f"{base}#{n}"
        return name

    def engine_provider(self, model: str) -> Provider:
        # Imported here so the HTTP-only gateway works without the transport module loaded.
        module = importlib.import_module("sluicegate.gateway.providers.engine.provider")
        provider: Provider = module.EngineProvider(self._redis, self._settings, model=model)
        return provider


def _max_connections(spec: dict[str, Any]) -> int:
    """A deployment's cap on calls in flight (``max_connections``; 0 or absent: none)."""
    value = spec.get("max_connections", 0)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ConfigError(f"max_connections must be a whole number >= 0: {spec!r}")
    return value

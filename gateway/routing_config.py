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

import os
import time
from dataclasses import dataclass, field
from typing import Any

from gateway.providers.anthropic import AnthropicProvider
from gateway.providers.azure import DEFAULT_API_VERSION, AzureProvider
from gateway.providers.base import Provider
from gateway.providers.bedrock import BedrockProvider
from gateway.providers.gemini import GeminiProvider
from gateway.providers.hosted import Sessions

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

"""Hosted-API deployments from the routing YAML (``provider: anthropic | gemini | azure |
bedrock``)::

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
from typing import Any

import httpx

from gateway.providers.anthropic import AnthropicProvider
from gateway.providers.azure import DEFAULT_API_VERSION, AzureProvider
from gateway.providers.base import Provider
from gateway.providers.bedrock import BedrockProvider
from gateway.providers.gemini import GeminiProvider

HOSTED_KINDS = ("anthropic", "gemini", "azure", "bedrock")


class ConfigError(ValueError):
    """The routing YAML is malformed."""


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
    kind: str, spec: dict[str, Any], name: str, client: httpx.AsyncClient, read_timeout_s: float
) -> Provider:
    model = str(spec["model"])
    common: dict[str, Any] = {"name": name, "model": model, "client": client}
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

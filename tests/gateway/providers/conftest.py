"""The fake provider servers (one per module) and a provider of each kind pointed at them."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import anthropic
import httpx
import msgspec
import pytest
import redis
from botocore.credentials import Credentials

from sluicegate.gateway.providers.anthropic import AnthropicProvider
from sluicegate.gateway.providers.azure import AzureProvider
from sluicegate.gateway.providers.bedrock import BedrockProvider
from sluicegate.gateway.providers.gemini import GeminiProvider
from sluicegate.gateway.providers.hosted import Sessions
from sluicegate.gateway.usage.stream import EVENT_FIELD, UsageEvent

from ..api.servers import ServerThread
from . import fake_anthropic, fake_bedrock
from .fake_anthropic import FakeAnthropic
from .fake_azure import API_KEY as AZURE_KEY
from .fake_azure import FakeAzure
from .fake_bedrock import FakeBedrock
from .fake_gemini import API_KEY as GEMINI_KEY
from .fake_gemini import FakeGemini

KINDS = ["anthropic", "gemini", "azure", "azure-v1", "bedrock"]


@pytest.fixture(scope="module")
def fakes() -> Iterator[dict[str, tuple[Any, str]]]:
    """Kind -> (fake server app, its base URL)."""
    apps = {
        "anthropic": FakeAnthropic(),
        "gemini": FakeGemini(),
        "azure": FakeAzure(),
        "bedrock": FakeBedrock(),
    }
    servers = {kind: ServerThread(app).start() for kind, app in apps.items()}
    yield {kind: (apps[kind], servers[kind].url) for kind in apps}
    for server in servers.values():
        server.stop()


ProviderFactory = Callable[[str, str], Any]


@pytest.fixture
async def make_provider(
    fakes: dict[str, tuple[Any, str]],
) -> AsyncIterator[ProviderFactory]:
    """``make_provider(kind, model)``: an adapter of that kind aimed at its fake server."""
    sessions = Sessions()

    def make(kind: str, model: str, **overrides: Any) -> Any:
        base = fakes[kind.split("-")[0]][1]
        name = f"{kind}:{model}"
        if kind == "anthropic":
            key = overrides.get("api_key", fake_anthropic.API_KEY)
            return AnthropicProvider(
                name=name, model=model, sessions=sessions, api_key=key, base_url=base
            )
        if kind == "gemini":
            key = overrides.get("api_key", GEMINI_KEY)
            return GeminiProvider(
                name=name, model=model, sessions=sessions, api_key=key, base_url=base
            )
        if kind in {"azure", "azure-v1"}:
            key = overrides.get("api_key", AZURE_KEY)
            deployment = model if kind == "azure" else None
            return AzureProvider(
                name=name,
                endpoint=base,
                model=model,
                sessions=sessions,
                api_key=key,
                deployment=deployment,
            )
        secret = overrides.get("secret", fake_bedrock.SECRET_KEY)
        return BedrockProvider(
            name=name,
            model=model,
            sessions=sessions,
            region=fake_bedrock.REGION,
            base_url=base,
            credentials=Credentials(fake_bedrock.ACCESS_KEY, secret),
        )

    yield make
    await sessions.close()


def hosted_routing(fakes: dict[str, tuple[Any, str]]) -> dict[str, Any]:
    """One public model per (provider kind, fake model): ``{kind}-{model}``, e.g.
    ``gemini-plain``; plus ``spread-limited``: a rate-limited Anthropic deployment first,
    then a working Gemini one; ``opens-then-overloaded``: a deployment that opens its stream
    and then reports an overload first, then a working one (``azure-opens-then-drops``: one
    that sends OpenAI's role-only chunk and ends); ``only-opens-then-overloaded``: no other."""

    def spec(kind: str, model: str) -> dict[str, Any]:
        base = fakes[kind.split("-")[0]][1]
        out: dict[str, Any] = {"provider": kind.split("-")[0], "model": model, "base_url": base}
        if kind == "azure":
            out |= {"endpoint": base, "deployment": model, "api_version": "2024-10-21"}
        elif kind == "azure-v1":
            out |= {"endpoint": base}
        if kind != "bedrock":
            out["api_key_env"] = f"TEST_{kind.split('-')[0].upper()}_KEY"
        else:
            out["region"] = fake_bedrock.REGION
        return out

    models = [
        {"name": f"{kind}-{model}", "deployments": [spec(kind, model)]}
        for kind in KINDS
        for model in ("plain", "limited", "bad")
    ]
    models.append(
        {
            "name": "spread-limited",
            "deployments": [
                {**spec("anthropic", "limited"), "weight": 1000},
                {**spec("gemini", "plain"), "weight": 0.001},
            ],
        }
    )
    anthropic = spec("anthropic", "plain")
    models += [
        {"name": "retry-once", "deployments": [spec("anthropic", "once-limited")]},
        {"name": "bedrock-nocount", "deployments": [spec("bedrock", "nocount")]},
        {"name": "anthropic-interleaved", "deployments": [spec("anthropic", "interleaved")]},
        {"name": "bedrock-interleaved", "deployments": [spec("bedrock", "interleaved")]},
        {
            "name": "falls-back",
            "deployments": [spec("anthropic", "down")],
            "fallbacks": ["gemini-plain"],
        },
        {
            "name": "small-window",
            "deployments": [{**anthropic, "context_window": 20, "name": "small"}],
            "context_window_fallbacks": ["bedrock-plain"],
        },
        {
            "name": "short-context",
            "deployments": [spec("anthropic", "short-context")],
            "context_window_fallbacks": ["gemini-plain"],
        },
        {
            "name": "opens-then-overloaded",
            "deployments": [
                {**spec("anthropic", "opens-overloaded"), "name": "opens", "weight": 1000},
                {**anthropic, "name": "steady", "weight": 0.001},
            ],
        },
        {
            "name": "only-opens-then-overloaded",
            "deployments": [{**spec("anthropic", "opens-overloaded"), "name": "only-opens"}],
        },
        {
            "name": "azure-opens-then-drops",
            "deployments": [
                {**spec("azure", "cut-1"), "name": "azure-opens", "weight": 1000},
                {**spec("azure", "plain"), "name": "azure-steady", "weight": 0.001},
            ],
        },
    ]
    return {"models": models}


@pytest.fixture(scope="module")
def hosted_usage_stream() -> str:
    """The Redis stream the hosted gateway appends its usage events to."""
    return f"sg:usage:hosted:{uuid.uuid4().hex[:10]}"


@pytest.fixture(scope="module")
def hosted_usage(
    hosted_usage_stream: str, redis_url: str
) -> Iterator[Callable[..., list[UsageEvent]]]:
    """``hosted_usage(request_id)``: the hosted gateway's usage events for one request
    (waits briefly for settlement, which follows a streamed response)."""
    client = redis.Redis.from_url(redis_url)
    decoder = msgspec.json.Decoder(UsageEvent)

    def read(request_id: str, *, wait_s: float = 2.0) -> list[UsageEvent]:
        deadline = time.monotonic() + wait_s
        while True:
            events = [
                event
                for _, fields in client.xrange(hosted_usage_stream)
                if (event := decoder.decode(fields[EVENT_FIELD])).request_id == request_id
            ]
            if events or time.monotonic() > deadline:
                return events
            time.sleep(0.02)

    yield read
    client.close()


@pytest.fixture(scope="module")
def hosted_gateway(
    fakes: dict[str, tuple[Any, str]],
    admin_database_url: str,
    redis_url: str,
    hosted_usage_stream: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, str]]:
    """A gateway (real PostgreSQL and Redis) in front of the fake providers: (URL, a key)."""
    import os
    from pathlib import Path

    import yaml

    from sluicegate.gateway.app import create_asgi_app
    from sluicegate.gateway.db.scratch import scratch_database
    from sluicegate.gateway.settings import Settings

    keys = {
        "TEST_ANTHROPIC_KEY": fake_anthropic.API_KEY,
        "TEST_GEMINI_KEY": GEMINI_KEY,
        "TEST_AZURE_KEY": AZURE_KEY,
        "AWS_ACCESS_KEY_ID": fake_bedrock.ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": fake_bedrock.SECRET_KEY,
    }
    saved = {name: os.environ.get(name) for name in keys}
    os.environ.update(keys)
    config = Path(tmp_path_factory.mktemp("hosted")) / "models.yaml"
    config.write_text(yaml.safe_dump(hosted_routing(fakes)))
    unique = uuid.uuid4().hex[:10]
    with scratch_database(admin_database_url, prefix="sg_hosted") as database_url:
        settings = Settings.from_env(
            database_url=database_url,
            redis_url=redis_url,
            master_key=f"sg-master-{unique}",
            config=str(config),
            usage_stream=hosted_usage_stream,
            run_usage_flusher=False,
            cooldown_failures=100,
        )
        server = ServerThread(create_asgi_app(settings)).start()
        response = httpx.post(
            f"{server.url}/admin/keys",
            json={"name": "hosted-test"},
            headers={"authorization": f"Bearer {settings.master_key}"},
        )
        assert response.status_code == 201, response.text
        try:
            yield server.url, str(response.json()["key"])
        finally:
            server.stop()
            client = redis.Redis.from_url(redis_url)
            client.delete(settings.usage_stream)
            client.close()
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


@pytest.fixture(scope="module")
def claude(hosted_gateway: tuple[str, str]) -> anthropic.Anthropic:
    url, key = hosted_gateway
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)

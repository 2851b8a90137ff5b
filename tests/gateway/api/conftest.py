"""One gateway (uvicorn, real PostgreSQL and Redis) per test module, in front of a real upstream.

Models of the routing config (``upstream`` names the upstream's behaviour, see servers.py):
``echo`` (alias ``echo-alias``), ``slow``, ``ctx``, ``breaks``, ``rich``; ``flaky`` = a refused
port, then ``echo``; ``dead`` = only a refused port; ``boom`` = only a 500-answering deployment;
``embed`` = an embeddings deployment; ``engine-only`` = an engine pool with no worker (requests it
cannot honour are 400s before any worker is needed); ``mixed`` = that engine pool, then ``echo``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import redis
import yaml

from sluicegate.gateway.app import create_asgi_app
from sluicegate.gateway.db.scratch import scratch_database
from sluicegate.gateway.http.protocol import CoalescingHttpToolsProtocol
from sluicegate.gateway.settings import Settings
from sluicegate.gateway.usage.stream import EVENT_FIELD, UsageEvent

from .servers import ServerThread, Upstream, dead_port


@pytest.fixture(scope="module")
def api_database_url(admin_database_url: str) -> Iterator[str]:
    with scratch_database(admin_database_url, prefix="sg_api") as url:
        yield url


@pytest.fixture(scope="module")
def upstream() -> Iterator[tuple[Upstream, str]]:
    app = Upstream()
    server = ServerThread(app).start()
    yield app, server.url + "/v1"
    server.stop()


def routing_config(upstream_url: str) -> dict[str, Any]:
    def openai(model: str, base_url: str = upstream_url, **extra: Any) -> dict[str, Any]:
        return {"provider": "openai", "base_url": base_url, "model": model, **extra}

    refused = f"http://127.0.0.1:{dead_port()}/v1"
    return {
        "models": [
            {"name": "echo", "aliases": ["echo-alias"], "deployments": [openai("echo")]},
        ]
        + [
            {"name": name, "deployments": [openai(name)]}
            for name in ("slow", "ctx", "breaks", "rich")
        ]
        + [
            {
                "name": "flaky",
                "deployments": [
                    openai("echo", refused, name="refused", weight=100),
                    openai("echo", name="good", weight=1),
                ],
            },
            {"name": "dead", "deployments": [openai("echo", refused, name="dead-one")]},
            {"name": "boom", "deployments": [openai("boom", name="boom-one")]},
            {"name": "embed", "deployments": [openai("embed-up", mode="embeddings")]},
            {
                "name": "mixed",
                "deployments": [
                    {"provider": "engine", "model": "gw9-no-such-worker"},
                    openai("echo", name="mixed-openai"),
                ],
            },
            {
                "name": "engine-only",
                "deployments": [{"provider": "engine", "model": "gw9-no-such-worker"}],
            },
        ]
    }


@pytest.fixture(scope="module")
def api_settings(
    api_database_url: str,
    redis_url: str,
    upstream: tuple[Upstream, str],
    tmp_path_factory: pytest.TempPathFactory,
) -> Settings:
    config = Path(tmp_path_factory.mktemp("routing")) / "models.yaml"
    config.write_text(yaml.safe_dump(routing_config(upstream[1])))
    unique = uuid.uuid4().hex[:10]
    return Settings.from_env(
        database_url=api_database_url,
        redis_url=redis_url,
        master_key=f"sg-master-{unique}",
        config=str(config),
        usage_stream=f"sg:usage:apitest:{unique}",
        run_usage_flusher=False,
        cooldown_failures=2,
        cooldown_s=60.0,
        first_token_timeout_s=5.0,
        max_body_bytes=64 * 1024,
        # Served over plain http here: Secure cookies would never come back to /ui.
        ui_insecure_cookies=True,
    )


@pytest.fixture(scope="module")
def gateway(api_settings: Settings) -> Iterator[str]:
    # Served as `sluicegate gateway` serves it: its response heads leave with their bodies.
    server = ServerThread(create_asgi_app(api_settings), http=CoalescingHttpToolsProtocol).start()
    yield server.url
    server.stop()
    client = redis.Redis.from_url(api_settings.redis_url)
    client.delete(api_settings.usage_stream)
    client.close()


@pytest.fixture(scope="module")
def make_key_record(gateway: str, api_settings: Settings) -> Callable[..., dict[str, Any]]:
    """Creates a key over the admin API; returns the admin API's answer (``key``, ``id``...)."""

    def create(**limits: Any) -> dict[str, Any]:
        response = httpx.post(
            f"{gateway}/admin/keys",
            json={"name": f"test-{uuid.uuid4().hex[:6]}", **limits},
            headers={"authorization": f"Bearer {api_settings.master_key}"},
        )
        assert response.status_code == 201, response.text
        return dict(response.json())

    return create


@pytest.fixture(scope="module")
def make_key(make_key_record: Callable[..., dict[str, Any]]) -> Callable[..., str]:
    """Creates a key over the admin API; returns its plaintext."""

    def create(**limits: Any) -> str:
        return str(make_key_record(**limits)["key"])

    return create


@pytest.fixture(scope="module")
def usage_events(api_settings: Settings) -> Iterator[Callable[..., list[UsageEvent]]]:
    """``usage_events(request_id)``: the usage events recorded for one request (waits briefly
    for settlement, which follows a streamed response)."""
    client = redis.Redis.from_url(api_settings.redis_url)
    decoder = msgspec.json.Decoder(UsageEvent)

    def read(request_id: str, *, wait_s: float = 2.0, expect: int = 1) -> list[UsageEvent]:
        deadline = time.monotonic() + wait_s
        while True:
            events = [
                event
                for _, fields in client.xrange(api_settings.usage_stream)
                if (event := decoder.decode(fields[EVENT_FIELD])).request_id == request_id
            ]
            if len(events) >= expect or time.monotonic() > deadline:
                return events
            time.sleep(0.02)

    yield read
    client.close()

"""Deployment selection, fallback before the first token, cooldowns."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import openai
import pytest
from redis.asyncio import Redis

from sluicegate.gateway.routing.router import ConfigError, Router
from sluicegate.gateway.settings import Settings

from .servers import Upstream

HELLO = [{"role": "user", "content": "hello world"}]


def _deployments(gateway: str, settings: Settings, model: str) -> dict[str, dict]:
    models = httpx.get(
        f"{gateway}/admin/models", headers={"authorization": f"Bearer {settings.master_key}"}
    ).json()
    route = next(m for m in models["data"] if m["name"] == model)
    return {d["name"]: d for d in route["deployments"]}


def test_fallback_before_first_token_then_cooldown(
    gateway: str,
    make_key: Callable[..., str],
    usage_events: Callable[..., list],
    api_settings: Settings,
) -> None:
    # "refused" has weight 100, so it is tried first until it cools down (2 failures).
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key=make_key(), max_retries=0)
    first = client.chat.completions.with_raw_response.create(model="flaky", messages=HELLO)
    assert first.parse().choices[0].message.content == "w0 w1 w2 w3 w4 "
    (event,) = usage_events(first.headers["x-request-id"])
    assert event.deployment == "good"
    stream = client.chat.completions.create(model="flaky", messages=HELLO, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == "w0 w1 w2 w3 w4 "
    deployments = _deployments(gateway, api_settings, "flaky")
    assert deployments["refused"]["healthy"] is False
    assert deployments["refused"]["cooldown_remaining_s"] > 50
    assert deployments["good"]["healthy"] is True


def test_only_deployment_cools_down_and_answers_503_fast(
    gateway: str, make_key: Callable[..., str], api_settings: Settings
) -> None:
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key=make_key(), max_retries=0)
    # Each request tries the deployment 1 + upstream_retries times, each a failure.
    attempts = api_settings.upstream_retries + 1
    for _ in range(-(-api_settings.cooldown_failures // attempts)):
        with pytest.raises(openai.InternalServerError) as caught:
            client.chat.completions.create(model="dead", messages=HELLO)
        assert caught.value.status_code == 503
        assert "could serve the request (last error" in caught.value.message
    started = time.perf_counter()
    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(model="dead", messages=HELLO, stream=True)
    assert caught.value.status_code == 503
    assert "is available right now" in caught.value.message
    assert time.perf_counter() - started < 0.5
    assert _deployments(gateway, api_settings, "dead")["dead-one"]["healthy"] is False
    assert "dead" not in {m.id for m in client.models.list()}


def test_upstream_5xx_is_retried_elsewhere_or_503(
    gateway: str,
    make_key: Callable[..., str],
    upstream: tuple[Upstream, str],
    api_settings: Settings,
) -> None:
    app, _ = upstream
    calls = app.calls["boom"]
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key=make_key(), max_retries=0)
    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(model="boom", messages=HELLO)
    assert caught.value.status_code == 503
    # Retried upstream_retries times after a backoff, then no other deployment: 503.
    assert app.calls["boom"] == calls + 1 + api_settings.upstream_retries


async def test_weighted_least_outstanding_order(redis_url: str) -> None:
    settings = Settings.from_env(redis_url=redis_url)
    redis = Redis.from_url(redis_url)
    router = Router(settings, redis, routes=[])
    (route,) = router.routes_from_config(
        {
            "models": [
                {
                    "name": "m",
                    "deployments": [
                        {
                            "provider": "openai",
                            "base_url": "http://a/v1",
                            "model": "x",
                            "name": "a",
                        },
                        {
                            "provider": "openai",
                            "base_url": "http://b/v1",
                            "model": "x",
                            "name": "b",
                            "weight": 3,
                        },
                    ],
                }
            ]
        }
    )
    a, b = route.deployments
    assert [d.name for d in await router.candidates(route)] == ["b", "a"]
    b.outstanding = 2  # (2+1)/3 = 1 per unit of weight, a has (0+1)/1 = 1: a tie
    assert {tuple(d.name for d in await router.candidates(route)) for _ in range(40)} == {
        ("a", "b"),
        ("b", "a"),
    }
    b.outstanding = 3
    assert [d.name for d in await router.candidates(route)] == ["a", "b"]
    a.cooldown_until = time.monotonic() + 60
    assert [d.name for d in await router.candidates(route)] == ["b"]
    with pytest.raises(ConfigError):
        router.routes_from_config({"models": [{"name": "m", "deployments": []}]})
    with pytest.raises(ConfigError):
        router.make_deployment({"provider": "carrier-pigeon", "model": "x"})
    await router.close()
    await redis.aclose()

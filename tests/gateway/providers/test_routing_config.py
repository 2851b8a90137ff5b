"""The routing YAML's checks for hosted deployments and fallbacks."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from sluicegate.gateway.routing.router import ConfigError, Router
from sluicegate.gateway.settings import Settings


@pytest.fixture
async def router(redis_url: str) -> Router:
    return Router(
        Settings.from_env(redis_url=redis_url),
        Redis.from_url(redis_url),
        routes=[],
    )


def model(name: str, *deployments: dict[str, object], **options: object) -> dict[str, object]:
    return {"name": name, "deployments": list(deployments), **options}


ANTHROPIC = {"provider": "anthropic", "model": "claude", "api_key_env": "TEST_ANTHROPIC_KEY"}


async def test_api_key_env_may_not_name_the_gateways_own_settings(router: Router) -> None:
    for name in ("SLUICEGATE_MASTER_KEY", "sluicegate_database_url"):
        with pytest.raises(ConfigError, match="SLUICEGATE_"):
            router.make_deployment({**ANTHROPIC, "api_key_env": name})
    await router.close()


async def test_fallbacks_must_name_known_models(router: Router) -> None:
    with pytest.raises(ConfigError, match="unknown 'nowhere'"):
        router.routes_from_config({"models": [model("a", ANTHROPIC, fallbacks=["nowhere"])]})
    routes = router.routes_from_config(
        {
            "models": [
                model("a", ANTHROPIC, fallbacks=["b"], context_window_fallbacks=["b"]),
                model("b", {**ANTHROPIC, "context_window": 200000}),
            ]
        }
    )
    assert routes[0].fallbacks == ["b"] and routes[1].deployments[0].context_window == 200000
    await router.close()


async def test_spill_over_needs_max_queue_ms(router: Router) -> None:
    with pytest.raises(ConfigError, match="max_queue_ms"):
        router.routes_from_config({"models": [model("a", ANTHROPIC, spill_over={"ms": 5})]})
    (route,) = router.routes_from_config(
        {"models": [model("a", ANTHROPIC, spill_over={"max_queue_ms": 250})]}
    )
    assert route.spill_over_ms == 250.0
    await router.close()


async def test_default_names_carry_no_address(router: Router) -> None:
    deployment = router.make_deployment(
        {"provider": "azure", "endpoint": "https://secret-host.example", "model": "gpt-4o"}
    )
    assert deployment.name == "azure:gpt-4o" and "secret" not in deployment.name
    await router.close()

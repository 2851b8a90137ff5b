"""Admin usage reports from the daily rollups, the per-key budget view, health and models."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import socket
import time
from pathlib import Path
from typing import Any

from litestar import Litestar
from litestar.testing import AsyncTestClient
from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluicegate.gateway.app import create_app
from sluicegate.gateway.db.usage import insert_usage
from sluicegate.gateway.settings import Settings
from sluicegate.gateway.usage.stream import UsageEvent, UsageRecorder

from .usage_rows import usage_row


async def _key(client: AsyncTestClient[Litestar], **fields: Any) -> str:
    response = await client.post("/admin/keys", json={"name": "k", **fields})
    assert response.status_code == 201
    return response.json()["id"]


async def _get(client: AsyncTestClient[Litestar], path: str, **params: Any) -> dict[str, Any]:
    response = await client.get(path, params=params)
    assert response.status_code == 200, response.text
    return response.json()


def _totals(requests: int, prompt: int, completion: int) -> dict[str, int]:
    return {
        "requests": requests,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "cost": 0.0,
        "cost_micros": 0,
    }


async def test_usage_grouped_filtered_and_budget(
    admin_client: AsyncTestClient[Litestar], db_sessionmaker: async_sessionmaker[AsyncSession]
) -> None:
    # Taken when the test runs, not at import (a run that crosses midnight), and last month
    # three days before this one starts, so that on the 1st it is not yesterday.
    today = dt.datetime.now(dt.UTC).replace(hour=12, minute=0, second=0, microsecond=0)
    yesterday = today - dt.timedelta(days=1)
    last_month = today.replace(day=1) - dt.timedelta(days=3)
    a = await _key(admin_client, token_budget=1000, budget_period="day")
    b = await _key(admin_client, token_budget=10_000, budget_period="month")
    c = await _key(admin_client)
    async with db_sessionmaker() as session, session.begin():
        await insert_usage(
            session,
            [
                usage_row(a, "m1", today, 100, 50),
                usage_row(a, "m2", today, 200, 0),
                usage_row(a, "m1", yesterday, 300, 300),
                usage_row(a, "m1", last_month, 1, 1),
                usage_row(b, "m1", today, 10, 10),
                usage_row(b, "m2", last_month, 5, 5),
                usage_row(c, "m1", last_month, 7, 0),
            ],
        )

    everything = await _get(admin_client, "/admin/usage")
    assert everything["group_by"] is None and everything["data"] == []
    assert everything["total"] == _totals(7, 623, 366)

    by_model = await _get(admin_client, "/admin/usage", group_by="model")
    assert by_model["data"] == [
        {"model": "m1", **_totals(5, 418, 361)},
        {"model": "m2", **_totals(2, 205, 5)},
    ]
    assert by_model["total"] == everything["total"]

    by_key = {
        row.pop("key_id"): row
        for row in (await _get(admin_client, "/admin/usage", group_by="key"))["data"]
    }
    assert by_key == {a: _totals(4, 601, 351), b: _totals(2, 15, 15), c: _totals(1, 7, 0)}

    recent = await _get(
        admin_client, "/admin/usage", group_by="day", since=yesterday.date().isoformat()
    )
    assert recent["data"] == [
        {"day": yesterday.date().isoformat(), **_totals(1, 300, 300)},
        {"day": today.date().isoformat(), **_totals(3, 310, 60)},
    ]
    only_yesterday = await _get(
        admin_client,
        "/admin/usage",
        since=yesterday.date().isoformat(),
        until=yesterday.date().isoformat(),
    )
    assert only_yesterday["total"] == _totals(1, 300, 300)
    filtered = await _get(admin_client, "/admin/usage", key_id=a, model="m1")
    assert filtered["total"] == _totals(3, 401, 351)

    a_usage = await _get(admin_client, f"/admin/keys/{a}/usage", group_by="model")
    assert a_usage["key_id"] == a and a_usage["total"] == _totals(4, 601, 351)
    # Budget counters are re-seeded from the committed usage when Redis has none.
    assert a_usage["budget"] == {
        "token_budget": 1000,
        "max_budget": None,
        "budget_period": "day",
        "period_start": today.date().isoformat(),
        "used_tokens": 350,
        "spend": 0.0,
        "spend_micros": 0,
        "remaining_tokens": 650,
        "remaining": None,
    }
    b_budget = (await _get(admin_client, f"/admin/keys/{b}/usage"))["budget"]
    assert b_budget["period_start"] == today.date().replace(day=1).isoformat()
    assert (b_budget["used_tokens"], b_budget["remaining_tokens"]) == (20, 9980)
    c_budget = (await _get(admin_client, f"/admin/keys/{c}/usage"))["budget"]
    assert c_budget == {
        "token_budget": None,
        "max_budget": None,
        "budget_period": None,
        "period_start": None,
        "used_tokens": 7,
        "spend": 0.0,
        "spend_micros": 0,
        "remaining_tokens": None,
        "remaining": None,
    }

    bad = await admin_client.get("/admin/usage", params={"group_by": "week"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "group_by"


async def test_recorded_usage_reaches_the_admin_api_through_the_apps_flusher(
    admin_client: AsyncTestClient[Litestar], gateway_settings: Settings, redis_client: Redis
) -> None:
    key_id = await _key(admin_client, token_budget=100, budget_period="month")
    now = time.time()
    await UsageRecorder(redis_client, gateway_settings).record(
        UsageEvent(
            request_id="via-app",
            key_id=key_id,
            model="tiny",
            prompt_tokens=12,
            completion_tokens=30,
            started_at=now - 0.2,
            finished_at=now,
        )
    )
    deadline = time.monotonic() + 5.0
    while (await _get(admin_client, "/admin/usage", key_id=key_id))["total"]["requests"] == 0:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    # The event bypassed admission, so the key's budget counter is seeded from the database.
    usage = await _get(admin_client, f"/admin/keys/{key_id}/usage")
    assert usage["total"] == _totals(1, 12, 30)
    assert usage["budget"]["remaining_tokens"] == 58


async def test_models_lists_the_routing_table(admin_client: AsyncTestClient[Litestar]) -> None:
    models = (await _get(admin_client, "/admin/models"))["data"]
    assert [m["name"] for m in models] == ["tiny"]
    assert models[0]["aliases"] == ["tiny-alias"]
    assert models[0]["deployments"][0]["model"] == "upstream-tiny"


async def test_openapi_documents_every_admin_and_health_route(
    admin_client: AsyncTestClient[Litestar],
) -> None:
    paths = (await admin_client.get("/schema/openapi.json")).json()["paths"]
    for path in (
        "/admin/keys",
        "/admin/keys/{key_id}",
        "/admin/keys/{key_id}/usage",
        "/admin/usage",
        "/admin/models",
        "/health/live",
        "/health/ready",
    ):
        assert path in paths


async def test_readiness_reports_the_database_but_does_not_gate_on_it(
    gateway_settings: Settings, routing_yaml: Path, db_proxy: Any
) -> None:
    settings = dataclasses.replace(
        gateway_settings, database_url=db_proxy.url, config=str(routing_yaml)
    )
    async with AsyncTestClient(create_app(settings)) as client:
        assert (await client.get("/health/live")).json() == {"status": "ok"}
        ready = await client.get("/health/ready")
        assert ready.status_code == 200, ready.text
        assert ready.json()["checks"] == {"redis": "ok", "routing": "ok", "database": "ok"}

        await db_proxy.stop()
        blip = await client.get("/health/ready")
        assert blip.status_code == 200, blip.text
        assert blip.json()["checks"]["database"].startswith("error")
        assert blip.json()["checks"]["redis"] == "ok"

        await db_proxy.start()
        assert (await client.get("/health/ready")).json()["checks"]["database"] == "ok"


async def test_readiness_fails_without_redis(
    gateway_settings: Settings, routing_yaml: Path
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead_port = probe.getsockname()[1]
    settings = dataclasses.replace(
        gateway_settings, redis_url=f"redis://127.0.0.1:{dead_port}/0", config=str(routing_yaml)
    )
    async with AsyncTestClient(create_app(settings)) as client:
        down = await client.get("/health/ready")
        assert down.status_code == 503
        body = down.json()
        assert body["checks"]["redis"].startswith("error")
        assert body["checks"]["database"] == "ok"
        assert body["error"]["type"] == "service_unavailable"
        assert "redis" in body["error"]["message"]
        assert (await client.get("/health/live")).status_code == 200


async def test_readiness_in_discovery_mode_reads_the_worker_registry(
    gateway_settings: Settings,
) -> None:
    async with AsyncTestClient(create_app(gateway_settings)) as client:
        ready = await client.get("/health/ready")
        assert ready.status_code == 200, ready.text
        assert ready.json()["checks"]["routing"] == "ok"

"""Limits held across gateway replicas sharing one Redis; budgets never overshot."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest
from redis.asyncio import Redis

from sluicegate.gateway.admission.keys import budget_period_id
from sluicegate.gateway.app import create_asgi_app
from sluicegate.gateway.settings import Settings

from .servers import ServerThread, dead_port

HI = [{"role": "user", "content": "hi"}]
"""Reserves ceil(2/3) + 4 = 5 prompt tokens; the upstream bills 2."""


@pytest.fixture(scope="module")
def second_gateway(api_settings: Settings) -> Iterator[str]:
    """Another replica: own process state, same Redis and database."""
    server = ServerThread(create_asgi_app(api_settings)).start()
    yield server.url
    server.stop()


def test_two_replicas_enforce_one_rpm_and_one_tpm_limit(
    gateway: str, second_gateway: str, make_key: Callable[..., str]
) -> None:
    key = make_key(rpm_limit=4)
    outcomes = []
    for i in range(8):
        url = (gateway, second_gateway)[i % 2]
        response = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": "echo", "messages": HI, "max_tokens": 1},
            headers={"authorization": f"Bearer {key}"},
        )
        outcomes.append(response.status_code)
    assert outcomes == [200] * 4 + [429] * 4

    key = make_key(tpm_limit=30)
    outcomes = []
    for i in range(6):
        url = (gateway, second_gateway)[i % 2]
        response = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": "echo", "messages": HI, "max_tokens": 10},
            headers={"authorization": f"Bearer {key}"},
        )
        outcomes.append(response.status_code)
        if response.status_code == 429:
            assert response.json()["error"]["type"] == "tokens"
    # 7 real tokens each after settling, 15 reserved per admission: 7+7+7+15 > 30.
    assert outcomes == [200] * 3 + [429] * 3


async def test_budget_never_overshoots_under_parallel_requests(
    gateway: str,
    second_gateway: str,
    make_key: Callable[..., str],
    usage_events: Callable[..., list],
    api_settings: Settings,
) -> None:
    budget = 200
    key = make_key(token_budget=budget, budget_period="month")
    clients = [
        openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        for url in (gateway, second_gateway)
    ]

    async def one(i: int) -> str | None:
        try:
            raw = await clients[i % 2].chat.completions.with_raw_response.create(
                model="echo", messages=HI, max_tokens=10
            )
        except openai.RateLimitError as exc:
            assert exc.code == "insufficient_quota"
            return None
        return raw.headers["x-request-id"]

    results = await asyncio.gather(*(one(i) for i in range(40)))
    for client in clients:
        await client.close()
    served = [r for r in results if r is not None]
    billed = 0
    for request_id in served:
        (event,) = usage_events(request_id)
        billed += event.prompt_tokens + event.completion_tokens
        key_id = event.key_id
    assert billed <= budget
    # 15 reserved per request: at least 13 fit at once; as real counts (7) settle, more do.
    assert len(served) >= budget // 15
    assert len(served) < 40

    period, _ = budget_period_id("month", time.time())
    redis = Redis.from_url(api_settings.redis_url)
    used = int(await redis.get(f"sg:rl:{{{key_id}}}:b:{period}") or 0)
    slots = await redis.zcard(f"sg:rl:{{{key_id}}}:slots")
    await redis.aclose()
    assert used == billed, "every reservation was settled to the real count"
    assert slots == 0


async def test_parallel_request_limit(gateway: str, make_key: Callable[..., str]) -> None:
    client = openai.AsyncOpenAI(
        base_url=f"{gateway}/v1", api_key=make_key(max_parallel_requests=2), max_retries=0
    )

    async def one() -> str:
        try:
            await client.chat.completions.create(model="slow", messages=HI, max_tokens=4)
        except openai.RateLimitError as exc:
            return str(exc.body["type"])  # type: ignore[index]
        return "ok"

    outcomes = sorted(await asyncio.gather(*(one() for _ in range(4))))
    await client.close()
    assert outcomes == ["ok", "ok", "requests", "requests"]


def test_a_sequential_client_never_meets_its_own_slot(
    gateway: str, make_key: Callable[..., str]
) -> None:
    """A call settles beside its response, not before it: the next request of a client that
    waits for each answer must still find its one slot free."""
    key = make_key(max_parallel_requests=1)
    statuses = []
    with httpx.Client(headers={"authorization": f"Bearer {key}"}, timeout=10) as client:
        for _ in range(60):
            response = client.post(
                f"{gateway}/v1/chat/completions", json={"model": "echo", "messages": HI}
            )
            statuses.append(response.status_code)
    assert statuses == [200] * 60


def test_redis_down_is_a_prompt_503(api_settings: Settings, make_key: Callable[..., str]) -> None:
    key = make_key()
    settings = dataclasses.replace(
        api_settings, redis_url=f"redis://127.0.0.1:{dead_port()}/0", run_usage_flusher=False
    )
    server = ServerThread(create_asgi_app(settings)).start()
    try:
        started = time.perf_counter()
        response = httpx.post(
            f"{server.url}/v1/chat/completions",
            json={"model": "echo", "messages": HI},
            headers={"authorization": f"Bearer {key}"},
            timeout=10,
        )
        elapsed = time.perf_counter() - started
    finally:
        server.stop()
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "service_unavailable"
    assert elapsed < 1.5

"""Spill-over with real processes: a model served by an engine worker first and an
OpenAI-compatible upstream second, ``spill_over: {max_queue_ms: 150}``. One request at a time
never queues, so the engine serves all of them; a burst longer than the engine can take queues
on the worker (one sequence at a time), its heartbeats say so, and the excess goes to the
upstream — only while the queue is long: once it drains, the engine serves again."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx
import pytest
import yaml

from ..gateway.api.servers import ServerThread, Upstream
from .conftest import Cluster, create_key, model_name

pytestmark = pytest.mark.timeout(300)


async def _ask(client: httpx.AsyncClient, url: str, key: str, model: str, tokens: int) -> str:
    response = await client.post(
        f"{url}/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": tokens,
            "temperature": 0,
            "ignore_eos": True,
        },
        headers={"authorization": f"Bearer {key}"},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    return response.headers["x-sluicegate-deployment"]


def test_spill_over_follows_the_engine_queue(
    cluster: Cluster,
    redis_url: str,
    e2e_database_url: str,
    tmp_path: Path,
) -> None:
    engine_model = model_name("spill")
    cluster.worker(engine_model, redis_url, "--max-num-seqs", "1")
    upstream = ServerThread(Upstream()).start()
    config = tmp_path / "models.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "models": [
                    {
                        "name": "spill",
                        "spill_over": {"max_queue_ms": 150},
                        "deployments": [
                            {"provider": "engine", "model": engine_model},
                            {
                                "provider": "openai",
                                "name": "paid-api",
                                "base_url": f"{upstream.url}/v1",
                                "model": "echo",
                            },
                        ],
                    }
                ]
            }
        )
    )
    gateway = cluster.gateway(
        e2e_database_url,
        redis_url,
        config=str(config),
        usage_stream=f"sg:usage:spill:{uuid.uuid4().hex[:8]}",
    )
    url = f"http://127.0.0.1:{gateway.port}"
    key, _ = create_key(url, "spill")

    async def sequential(count: int) -> Counter[str]:
        async with httpx.AsyncClient() as client:
            return Counter([await _ask(client, url, key, "spill", 8) for _ in range(count)])

    async def burst(clients: int, seconds: float) -> list[tuple[float, str]]:
        served: list[tuple[float, str]] = []
        stop_at = time.monotonic() + seconds
        async with httpx.AsyncClient() as client:

            async def one_client() -> None:
                while time.monotonic() < stop_at:
                    served.append((time.monotonic(), await _ask(client, url, key, "spill", 48)))

            await asyncio.gather(*(one_client() for _ in range(clients)))
        return served

    try:
        quiet = asyncio.run(sequential(5))
        assert set(quiet) == {f"engine:{engine_model}"}, quiet
        served = asyncio.run(burst(clients=6, seconds=8.0))
        by = Counter(name for _, name in served)
        assert by["paid-api"] > 0, by  # the excess spilled over
        assert by[f"engine:{engine_model}"] > 0, by  # while the engine kept serving
        # The queue drains; one heartbeat later the engine takes everything again.
        time.sleep(2.5)
        after = asyncio.run(sequential(5))
        assert set(after) == {f"engine:{engine_model}"}, after
    finally:
        upstream.stop()

"""A whole stack on a Redis topology: the gateway (uvicorn thread) and an engine worker (this
test's event loop) both connected through the topology's URL, on the tests' PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sluicegate.engine.demo_model import create_demo_model
from sluicegate.engine.redis_client import async_client, pubsub_client
from sluicegate.engine.serving.async_engine import AsyncEngine
from sluicegate.engine.worker import Worker, WorkerOptions
from sluicegate.gateway.app import create_asgi_app
from sluicegate.gateway.settings import Settings
from tests.gateway.api.servers import ServerThread


@pytest.fixture(scope="module")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_demo_model(tmp_path_factory.mktemp("topology-model"))


@dataclasses.dataclass
class Stack:
    base_url: str
    settings: Settings
    model: str
    http: httpx.AsyncClient

    @property
    def admin(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.settings.master_key}"}

    async def create_key(self) -> tuple[str, str]:
        created = await self.http.post("/admin/keys", json={"name": "topo"}, headers=self.admin)
        assert created.status_code == 201, created.text
        return created.json()["key"], created.json()["id"]

    async def wait_model(self, timeout_s: float = 30.0) -> None:
        key, _ = await self.create_key()
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            listed = await self.http.get("/v1/models", headers={"authorization": f"Bearer {key}"})
            if any(m["id"] == self.model for m in listed.json().get("data", [])):
                return
            assert asyncio.get_running_loop().time() < deadline, listed.text
            await asyncio.sleep(0.2)

    async def chat(self, key: str, *, stream: bool = False, max_tokens: int = 6) -> Any:
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": "Hello there"}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": stream,
        }
        return await self.http.post(
            "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}
        )


@pytest.fixture
async def stack_on(gateway_settings: Settings, demo_model_dir: Path) -> AsyncIterator[Any]:
    """``async with stack_on(url) as stack``: gateway and worker on that Redis URL."""

    @contextlib.asynccontextmanager
    async def start(url: str) -> AsyncIterator[Stack]:
        settings = dataclasses.replace(
            gateway_settings, redis_url=url, config="", usage_flush_interval_s=0.1
        )
        model = f"topo-{uuid.uuid4().hex[:8]}"
        engine = AsyncEngine(demo_model_dir, num_kv_blocks=64)
        await engine.start()
        redis, cancels = async_client(url), pubsub_client(url)
        options = WorkerOptions(model_name=model, redis_url=url, worker_id=f"tw-{model}")
        worker = Worker(engine, redis, options, pubsub_redis=cancels)
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        server = ServerThread(create_asgi_app(settings)).start()
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                yield Stack(server.url, settings, model, http)
        finally:
            await asyncio.to_thread(server.stop)
            stop.set()
            await asyncio.wait_for(task, 30)
            await engine.shutdown()
            await redis.aclose()
            await cancels.aclose()

    yield start

"""Without a routing file the models are those of live engine workers; the CLI serves."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import httpx
from redis.asyncio import Redis

from sluicegate.engine import protocol, redis_names
from sluicegate.engine.worker.liveness import LivenessThread
from sluicegate.gateway.routing.router import Router
from sluicegate.gateway.settings import Settings

from .servers import free_port


async def test_models_discovered_from_worker_heartbeats(redis_url: str) -> None:
    model = f"disc-{uuid.uuid4().hex[:8]}"
    settings = Settings.from_env(redis_url=redis_url, config="")
    redis = Redis.from_url(redis_url)
    router = Router.from_settings(settings, redis)
    assert router.discovering
    assert await router.resolve(model) is None
    # The worker's own liveness thread registers it: heartbeat key, registry, model registry.
    liveness = LivenessThread(redis_url, model, "w1", list)
    liveness.publish(
        protocol.Heartbeat(
            worker_id="w1", model=model, served_model_name=model, version="test", time=time.time()
        )
    )
    liveness.beat()
    try:
        router._refreshed_at = 0.0  # the registry is read at most once a second
        route = await router.resolve(model)
        assert route is not None
        (deployment,) = route.deployments
        assert (deployment.kind, deployment.model) == ("engine", model)
        assert route in await router.live_routes()
        assert any(m["name"] == model for m in router.describe())
    finally:
        liveness.stop()
        await redis.zrem(redis_names.MODEL_REGISTRY, model)
        await redis.delete(redis_names.worker_registry(model))
        await router.close()
        await redis.aclose()


def test_sluicegate_gateway_command_serves(api_settings: Settings) -> None:
    port = free_port()
    env = {
        **os.environ,
        "SLUICEGATE_DATABASE_URL": api_settings.database_url,
        "SLUICEGATE_REDIS_URL": api_settings.redis_url,
        "SLUICEGATE_CONFIG": api_settings.config,
        "SLUICEGATE_RUN_USAGE_FLUSHER": "false",
    }
    command = [sys.executable, "-m", "sluicegate.gateway.cli", "gateway", "--host", "127.0.0.1"]
    process = subprocess.Popen([*command, "--port", str(port)], env=env)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                response = httpx.get(f"http://127.0.0.1:{port}/health/live", timeout=1)
                break
            except httpx.TransportError:
                assert process.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
        assert response.status_code == 200
        unauthorized = httpx.get(f"http://127.0.0.1:{port}/v1/models")
        assert unauthorized.status_code == 401
        assert unauthorized.headers["x-request-id"]
    finally:
        process.terminate()
        process.wait(15)


def test_gateway_app_never_imports_torch() -> None:
    code = "import sys, sluicegate.gateway.app, sluicegate.gateway.serve; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0

"""Stored Responses while PostgreSQL is down: an answer still goes out (it was generated and
billed; only storing it failed), and what must read the database is a 503 in OpenAI's shape,
never a 500."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from sluicegate.gateway.app import create_asgi_app
from sluicegate.gateway.settings import Settings

from ..api.servers import ServerThread, Upstream
from .conftest import TcpProxy


@pytest.fixture
def upstream_url() -> Iterator[str]:
    server = ServerThread(Upstream()).start()
    yield f"{server.url}/v1"
    server.stop()


async def test_an_outage_loses_the_stored_copy_not_the_answer(
    gateway_settings: Settings, db_proxy: TcpProxy, upstream_url: str, tmp_path: Path
) -> None:
    config = tmp_path / "models.yaml"
    deployment = {"provider": "openai", "base_url": upstream_url, "model": "echo"}
    config.write_text(yaml.safe_dump({"models": [{"name": "echo", "deployments": [deployment]}]}))
    settings = dataclasses.replace(
        gateway_settings, database_url=db_proxy.url, config=str(config), run_usage_flusher=False
    )
    server = ServerThread(create_asgi_app(settings)).start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            made = await client.post(
                "/admin/keys",
                json={"name": "outage"},
                headers={"authorization": f"Bearer {settings.master_key}"},
            )
            client.headers["authorization"] = f"Bearer {made.json()['key']}"
            first = await client.post("/v1/responses", json={"model": "echo", "input": "one"})
            kept = first.json()["id"]

            await db_proxy.stop()
            answered = await client.post("/v1/responses", json={"model": "echo", "input": "two"})
            assert answered.status_code == 200 and answered.json()["status"] == "completed"
            continued = {"model": "echo", "input": "three", "previous_response_id": kept}
            for response in (
                await client.get(f"/v1/responses/{kept}"),
                await client.post("/v1/responses", json=continued),
            ):
                assert response.status_code == 503, response.text
                assert response.json()["error"]["type"] == "service_unavailable"

            await db_proxy.start()
            assert (await client.get(f"/v1/responses/{kept}")).status_code == 200
            lost = answered.json()["id"]
            assert (await client.get(f"/v1/responses/{lost}")).status_code == 404
    finally:
        server.stop()

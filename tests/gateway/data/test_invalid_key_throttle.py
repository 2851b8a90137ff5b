"""Key spraying over HTTP: unknown keys cost a client address a bounded number of queries."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from litestar.testing import AsyncTestClient

from sluicegate.gateway.app import create_app
from sluicegate.gateway.keys.records import generate_key
from sluicegate.gateway.settings import Settings


async def test_sprayed_keys_get_429_in_openai_shape_per_forwarded_address(
    gateway_settings: Settings, routing_yaml: Path
) -> None:
    settings = dataclasses.replace(
        gateway_settings,
        config=str(routing_yaml),
        invalid_key_lookups_per_min=2,
        client_address_header="x-forwarded-for",
    )
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}

    async def attempt(address: str) -> tuple[int, dict[str, object], dict[str, str]]:
        response = await client.post(
            "/v1/chat/completions",
            json=body,
            headers={
                "authorization": f"Bearer {generate_key()[0]}",
                "x-forwarded-for": f"{address}, 10.9.9.9",
            },
        )
        return response.status_code, response.json(), dict(response.headers)

    async with AsyncTestClient(create_app(settings)) as client:
        assert [(await attempt("203.0.113.7"))[0] for _ in range(2)] == [401, 401]
        status, error, headers = await attempt("203.0.113.7")
        assert status == 429
        assert error["error"]["code"] == "invalid_api_key_rate_limited"  # type: ignore[index]
        assert int(headers["retry-after"]) >= 1
        assert (await attempt("198.51.100.1"))[0] == 401

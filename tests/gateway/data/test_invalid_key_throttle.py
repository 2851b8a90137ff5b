"""Key spraying over HTTP: unknown keys cost a client address a bounded number of queries, and
that address is one a client cannot choose (``trusted_proxy_count``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from litestar.testing import AsyncTestClient

from sluicegate.gateway.app import create_app
from sluicegate.gateway.keys.records import generate_key
from sluicegate.gateway.settings import Settings

BODY = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


async def _attempt(
    client: AsyncTestClient, forwarded: Sequence[str] = ()
) -> tuple[int, dict[str, object], dict[str, str]]:
    """A chat request with a fresh unknown key; each of ``forwarded`` is one header line."""
    headers = [("authorization", f"Bearer {generate_key()[0]}")]
    headers += [("x-forwarded-for", line) for line in forwarded]
    response = await client.post("/v1/chat/completions", json=BODY, headers=headers)
    return response.status_code, response.json(), dict(response.headers)


def _settings(base: Settings, routing_yaml: Path, **overrides: object) -> Settings:
    return dataclasses.replace(
        base, config=str(routing_yaml), invalid_key_lookups_per_min=2, **overrides
    )


async def test_sprayed_keys_get_429_in_openai_shape_per_forwarded_address(
    gateway_settings: Settings, routing_yaml: Path
) -> None:
    # Two proxies: the outer one saw the client, the inner one (10.9.9.9) saw the outer one.
    settings = _settings(gateway_settings, routing_yaml, trusted_proxy_count=2)
    async with AsyncTestClient(create_app(settings)) as client:
        for _ in range(2):
            assert (await _attempt(client, ["203.0.113.7, 10.9.9.9"]))[0] == 401
        status, error, headers = await _attempt(client, ["203.0.113.7, 10.9.9.9"])
        assert status == 429
        assert error["error"]["code"] == "invalid_api_key_rate_limited"  # type: ignore[index]
        assert int(headers["retry-after"]) >= 1
        assert (await _attempt(client, ["198.51.100.1, 10.9.9.9"]))[0] == 401


async def test_a_spoofed_left_most_entry_does_not_change_the_throttled_address(
    gateway_settings: Settings, routing_yaml: Path
) -> None:
    settings = _settings(gateway_settings, routing_yaml, trusted_proxy_count=1)
    async with AsyncTestClient(create_app(settings)) as client:
        # The client sends its own x-forwarded-for; the one ingress appends what it saw.
        assert (await _attempt(client, ["1.1.1.1, 203.0.113.7"]))[0] == 401
        assert (await _attempt(client, ["2.2.2.2, 203.0.113.7"]))[0] == 401
        assert (await _attempt(client, ["3.3.3.3, 203.0.113.7"]))[0] == 429
        # An ingress that adds a header line of its own instead of appending to the client's.
        assert (await _attempt(client, ["4.4.4.4", "203.0.113.7"]))[0] == 429
        assert (await _attempt(client, ["203.0.113.7, 198.51.100.9"]))[0] == 401


async def test_without_trusted_proxies_the_header_is_not_read(
    gateway_settings: Settings, routing_yaml: Path
) -> None:
    settings = _settings(gateway_settings, routing_yaml)
    assert settings.trusted_proxy_count == 0
    async with AsyncTestClient(create_app(settings)) as client:
        # Each "address" is the client's own claim: all of them are the one TCP peer.
        statuses = [(await _attempt(client, [f"192.0.2.{n}"]))[0] for n in range(3)]
        assert statuses == [401, 401, 429]


async def test_a_header_shorter_than_the_proxy_chain_falls_back_to_the_peer(
    gateway_settings: Settings, routing_yaml: Path
) -> None:
    settings = _settings(gateway_settings, routing_yaml, trusted_proxy_count=2)
    async with AsyncTestClient(create_app(settings)) as client:
        # One entry where two proxies would have left two: it did not come through them.
        statuses = [(await _attempt(client, [f"192.0.2.{n}"]))[0] for n in range(3)]
        assert statuses == [401, 401, 429]
        assert (await _attempt(client, ["192.0.2.1, 10.9.9.9"]))[0] == 401

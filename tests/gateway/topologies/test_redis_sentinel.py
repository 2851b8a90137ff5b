"""The gateway and a worker through a real Sentinel (``redis+sentinel://``), across a failover."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from sluicegate.engine.redis_client import parse_redis_url, sync_client

from .redis_servers import SENTINEL_SERVICE, SentinelPair

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SentinelPair]:
    servers = SentinelPair(tmp_path_factory.mktemp("redis-sentinel"))
    try:
        yield servers.start()
    finally:
        servers.close()


def test_sentinel_urls_parse() -> None:
    topology = parse_redis_url(
        "rediss+sentinel://:pw@10.0.0.1:26379,10.0.0.2/svc/2?sentinel_password=s"
    )
    assert topology.kind == "sentinel"
    assert topology.nodes == [("10.0.0.1", 26379), ("10.0.0.2", 26379)]
    assert (topology.service, topology.db) == ("svc", 2)
    assert topology.auth == {"password": "pw", "ssl": True}
    assert topology.sentinel_auth == {"password": "s"}
    assert parse_redis_url("rediss://h:6380/1").kind == "single"
    with pytest.raises(ValueError, match="service name"):
        parse_redis_url("redis+sentinel://h:26379")


def test_a_sentinel_url_reaches_the_master(sentinel: SentinelPair) -> None:
    client = sync_client(sentinel.url)
    try:
        client.set("sg:probe:sentinel", "1")
        assert client.connection_pool.get_master_address()[1] == sentinel.master_port_now()
    finally:
        client.close()


async def _answer_within(stack: Any, key: str, timeout_s: float, *, stream: bool = False) -> Any:
    """The first 200 within ``timeout_s`` (a failover refuses requests for a moment: until
    the worker's heartbeat reaches the new master, the registry there may not list it)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        answer = await stack.chat(key, stream=stream)
        if answer.status_code == 200 or asyncio.get_running_loop().time() > deadline:
            return answer
        await asyncio.sleep(0.25)


async def test_gateway_and_worker_follow_a_failover(sentinel: SentinelPair, stack_on: Any) -> None:
    async with stack_on(sentinel.url) as stack:
        await stack.wait_model()
        key, _ = await stack.create_key()
        answer = await stack.chat(key)
        assert answer.status_code == 200, answer.text

        before = sentinel.master_port_now()
        await asyncio.to_thread(sentinel.fail_over)
        assert sentinel.master_port_now() != before, SENTINEL_SERVICE

        after = await _answer_within(stack, key, timeout_s=30)
        assert after.status_code == 200, after.text
        assert after.json()["usage"]["completion_tokens"] == 6
        streamed = await _answer_within(stack, key, timeout_s=30, stream=True)
        assert streamed.status_code == 200, streamed.text
        assert streamed.text.rstrip().endswith("data: [DONE]")

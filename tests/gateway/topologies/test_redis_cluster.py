"""The gateway and a worker on a real three-master Redis Cluster (``redis+cluster://``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from sluicegate.engine import redis_names
from sluicegate.engine.redis_client import async_client, sync_client
from sluicegate.gateway.redis.batch import CommandBatcher

from .redis_servers import SLOW_INCR, ClusterOfThree

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ClusterOfThree]:
    servers = ClusterOfThree(tmp_path_factory.mktemp("redis-cluster"))
    try:
        yield servers.start()
    finally:
        servers.close()


def test_clients_for_a_cluster_url_reach_every_master(cluster: ClusterOfThree) -> None:
    client = sync_client(cluster.url)
    try:
        assert isinstance(client, redis.RedisCluster)
        assert len(client.get_primaries()) == 3
        keys = [f"sg:probe:{{{i}}}" for i in range(30)]
        for key in keys:
            client.set(key, key)
        assert [client.get(k) for k in keys] == [k.encode() for k in keys]
        per_node = [redis.Redis(port=p).dbsize() for p in cluster.ports]
        assert all(n > 0 for n in per_node), per_node
    finally:
        client.close()


async def _sse_text(response: Any) -> str:
    text = ""
    for line in response.text.splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            for choice in json.loads(line[6:]).get("choices", []):
                text += choice.get("delta", {}).get("content") or ""
    return text


async def test_gateway_and_worker_serve_on_the_cluster(
    cluster: ClusterOfThree, stack_on: Any
) -> None:
    async with stack_on(cluster.url) as stack:
        await stack.wait_model()
        key, key_id = await stack.create_key()
        # A team key's admission books the key and its team in one script: one slot.
        team = await stack.http.post(
            "/admin/teams", json={"name": "topo-team", "rpm_limit": 100}, headers=stack.admin
        )
        assert team.status_code == 201, team.text
        team_key = await stack.http.post(
            "/admin/keys",
            json={"name": "topo-member", "team_id": team.json()["id"], "rpm_limit": 50},
            headers=stack.admin,
        )
        assert team_key.status_code == 201, team_key.text
        assert (await stack.chat(team_key.json()["key"])).status_code == 200

        answer = await stack.chat(key)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 6

        streamed = await stack.chat(key, stream=True)
        assert streamed.status_code == 200, streamed.text
        assert streamed.text.rstrip().endswith("data: [DONE]")
        assert await _sse_text(streamed)

        ready = await stack.http.get("/health/ready")
        assert ready.json()["checks"]["redis"] == "ok", ready.text

        # Usage travels through the usage stream and the flusher to PostgreSQL.
        for _ in range(100):
            usage = await stack.http.get(f"/admin/keys/{key_id}/usage", headers=stack.admin)
            if usage.json()["total"]["requests"] == 2:
                break
            await asyncio.sleep(0.1)
        assert usage.json()["total"]["requests"] == 2, usage.text

        # Revocation reaches the key cache over pub/sub on the cluster.
        revoked = await stack.http.delete(f"/admin/keys/{key_id}", headers=stack.admin)
        assert revoked.status_code == 200, revoked.text
        for _ in range(50):
            if (await stack.chat(key, max_tokens=1)).status_code == 401:
                break
            await asyncio.sleep(0.1)
        assert (await stack.chat(key, max_tokens=1)).status_code == 401

        # The model registry is a sorted set on the cluster, not found by SCAN.
        client = async_client(cluster.url)
        try:
            assert await client.zscore(redis_names.MODEL_REGISTRY, stack.model)
        finally:
            await client.aclose()


def test_keys_used_together_share_a_slot() -> None:
    """What a worker reads or checks together (XREADGROUP of both its streams, MGET of the
    heartbeats) lies in one slot; admission scripts are proven on the cluster above."""
    model = "m"
    together = [
        [redis_names.request_stream(model), redis_names.worker_stream(model, "w1")],
        [redis_names.heartbeat_key(model, "w1"), redis_names.heartbeat_key(model, "w2")],
    ]
    for keys in together:
        assert len({key_slot(k.encode()) for k in keys}) == 1, keys


async def test_batched_commands_reach_their_slots_on_the_cluster(cluster: ClusterOfThree) -> None:
    """The request path's batches (sluicegate.gateway.redis.batch) mix keys of every slot: the cluster
    pipeline sends each command to its node and the replies come back in order."""
    client = async_client(cluster.url)
    batcher = CommandBatcher(client)
    keys = [f"sg:batch:{{{i}}}" for i in range(40)]
    try:
        replies = await asyncio.gather(
            *(batcher.execute(("INCRBY", key, i), ("GET", key)) for i, key in enumerate(keys))
        )
        assert replies == [[i, str(i).encode()] for i in range(40)]
        assert batcher.round_trips < len(keys)
        assert len({key_slot(key.encode()) for key in keys}) > 1
    finally:
        await client.delete(*keys)
        await client.aclose()


@pytest.mark.parametrize("batched", [False, True])
async def test_a_script_that_timed_out_is_not_run_again(
    cluster: ClusterOfThree, batched: bool
) -> None:
    """A command that timed out may have run (the admission script books limits): the cluster
    client must not send it again, as redis-py's cluster retries would by default."""
    client = async_client(cluster.url, socket_timeout=0.2)
    # Redis runs one script at a time: this client's GET waits out the slow one and any resend
    # queued before it.
    checker = async_client(cluster.url)
    key = f"sg:once:{{{batched}}}"
    try:
        with pytest.raises(redis.exceptions.TimeoutError):
            if batched:
                await CommandBatcher(client).execute(("EVAL", SLOW_INCR, 1, key), ("GET", key))
            else:
                await client.eval(SLOW_INCR, 1, key)
        assert await checker.get(key) == b"1"
    finally:
        await checker.delete(key)
        await client.aclose()
        await checker.aclose()

"""The request path's own Redis connection (sluicegate.gateway.redis.direct), on real redis-servers."""

from __future__ import annotations

import asyncio
import subprocess
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import redis
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sluicegate.gateway.redis.batch import CommandBatcher
from sluicegate.gateway.redis.direct import Address, DirectConnection
from tests.gateway.topologies.redis_servers import SLOW_INCR, free_ports, redis_server

Open = Callable[..., DirectConnection]


def direct(url: str, timeout_s: float = 5.0) -> DirectConnection:
    address = Address.from_url(url)
    assert address is not None
    return DirectConnection(address, connect_timeout_s=1.0, timeout_s=timeout_s)


@pytest.fixture
async def redis_client(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
async def opened() -> AsyncIterator[Open]:
    """``direct`` for the test; each connection it opened is closed after it."""
    connections: list[DirectConnection] = []

    def open_connection(url: str, timeout_s: float = 5.0) -> DirectConnection:
        connections.append(direct(url, timeout_s))
        return connections[-1]

    yield open_connection
    for connection in connections:
        await connection.aclose()


@pytest.fixture
async def key(redis_client: Redis) -> AsyncIterator[str]:
    """A key of the test's own (and its ``:s`` stream), deleted after it."""
    name = f"sg:test:direct:{uuid.uuid4().hex}"
    yield name
    await redis_client.delete(name, name + ":s")


def test_single_server_urls_only() -> None:
    assert Address.from_url("redis://u:p%40ss@h:7000/3") == Address(
        host="h", port=7000, username="u", password="p@ss", db=3
    )
    assert Address.from_url("redis://h") == Address(host="h")
    assert Address.from_url("unix:///run/redis.sock?db=2") == Address(
        host="127.0.0.1", path="/run/redis.sock", db=2
    )
    # Topologies redis-py follows, and options only redis-py honours, stay with redis-py.
    assert Address.from_url("redis+sentinel://h:26379/mymaster") is None
    assert Address.from_url("redis+cluster://h:7000,h:7001") is None
    assert Address.from_url("rediss://h") is None
    assert Address.from_url("redis://h?socket_keepalive=true") is None


async def test_replies_match_redis_py_and_come_back_in_order(
    redis_url: str, redis_client: Redis, opened: Open, key: str
) -> None:
    connection = opened(redis_url)
    sha = await redis_client.script_load("return {KEYS[1], tonumber(ARGV[1]) + 1, {'x'}}")
    replies = await asyncio.gather(
        *(connection.exchange((("EVALSHA", sha, 1, key, i), ("INCRBY", key, i))) for i in range(50))
    )
    assert replies[0][0] == await redis_client.evalsha(sha, 1, key, 0)
    assert [r[0][1] for r in replies] == list(range(1, 51))
    # Each exchange's INCRBY ran in the order the exchanges were sent.
    assert [r[1] for r in replies] == [sum(range(i + 1)) for i in range(50)]
    (entry_id,) = await connection.exchange((("XADD", key + ":s", "*", "f", "v"),))
    assert (await redis_client.xrange(key + ":s"))[0][0] == entry_id


async def test_an_error_reply_is_that_commands_own(
    redis_url: str, redis_client: Redis, opened: Open, key: str
) -> None:
    await redis_client.set(key, "text")
    missing, not_a_number, text = await opened(redis_url).exchange(
        (("EVALSHA", "0" * 40, 0), ("INCR", key), ("GET", key))
    )
    assert isinstance(missing, NoScriptError)
    assert isinstance(not_a_number, ResponseError)
    assert not isinstance(not_a_number, NoScriptError)
    assert text == b"text"


async def test_a_timed_out_exchange_is_never_sent_again(
    redis_url: str, redis_client: Redis, opened: Open, key: str
) -> None:
    connection = opened(redis_url, timeout_s=0.2)
    slow = connection.exchange((("EVAL", SLOW_INCR, 1, key),))
    behind = connection.exchange((("INCR", key),))
    results = await asyncio.gather(slow, behind, return_exceptions=True)
    # Both were in flight on the connection that timed out: neither may be read as done.
    assert all(isinstance(r, RedisTimeoutError) for r in results), results
    # Another client's GET waits out the script: it and the INCR behind it ran once each.
    assert await redis_client.get(key) == b"2"
    # The next exchange connects afresh.
    assert await connection.exchange((("INCR", key),)) == [3]


async def test_each_exchange_gets_its_whole_timeout(
    redis_url: str, redis_client: Redis, opened: Open, key: str
) -> None:
    connection = opened(redis_url, timeout_s=0.3)
    # Answered at once; its deadline stays armed, 0.3 s from now.
    assert await connection.exchange((("PING",),)) == [b"PONG"]
    await asyncio.sleep(0.15)
    sent = time.perf_counter()
    with pytest.raises(RedisTimeoutError):
        await connection.exchange((("EVAL", SLOW_INCR, 1, key),))
    # Timed out from its own start, not from the earlier exchange's.
    assert 0.29 <= time.perf_counter() - sent < 0.55
    assert await redis_client.get(key) == b"1"


async def test_a_connection_the_server_closed_is_replaced(
    redis_url: str, redis_client: Redis, opened: Open
) -> None:
    connection = opened(redis_url)
    (client_id,) = await connection.exchange((("CLIENT", "ID"),))
    assert await redis_client.client_kill_filter(_id=client_id) == 1
    deadline = time.monotonic() + 5
    while True:  # until this side has seen the close: a command is never sent into it
        try:
            assert await connection.exchange((("PING",),)) == [b"PONG"]
            break
        except RedisConnectionError:
            assert time.monotonic() < deadline
    assert await connection.exchange((("PING",),)) == [b"PONG"]


@pytest.fixture(scope="module")
def secured_redis() -> Iterator[tuple[int, str]]:
    """A redis-server that wants a password, on a port and a Unix socket: (port, socket)."""
    port = free_ports(1)[0]
    workdir = Path(tempfile.mkdtemp(prefix="sg-direct-redis-"))
    socket = str(workdir / "redis.sock")
    process = subprocess.Popen(
        [redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--unixsocket", socket, "--requirepass", "s3cret", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    client = redis.Redis(port=port, password="s3cret", socket_connect_timeout=0.2)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.02)
    client.close()
    yield port, socket
    process.kill()
    process.wait(10)


@pytest.mark.parametrize("over", ["tcp", "unix"])
async def test_password_and_database_are_set_up_first(
    secured_redis: tuple[int, str], over: str, opened: Open
) -> None:
    port, socket = secured_redis
    base = f"redis://:s3cret@127.0.0.1:{port}" if over == "tcp" else f"unix://:s3cret@{socket}"
    url = f"{base}/5" if over == "tcp" else f"{base}?db=5"
    await opened(url).exchange((("SET", f"in-db-5-{over}", "yes"),))
    check = redis.Redis(port=port, password="s3cret", db=5)
    assert check.get(f"in-db-5-{over}") == b"yes"
    check.close()
    refused = opened(f"redis://:wrong@127.0.0.1:{port}/0")
    with pytest.raises(RedisConnectionError):
        await refused.exchange((("PING",),))


async def test_the_batcher_uses_it(
    redis_url: str, redis_client: Redis, opened: Open, key: str
) -> None:
    batcher = CommandBatcher(redis_client, opened(redis_url))
    replies = await asyncio.gather(
        *(batcher.execute(("INCRBY", key, 1), ("GET", key)) for _ in range(20))
    )
    assert [r[0] for r in replies] == list(range(1, 21))
    assert batcher.round_trips < 20


def test_it_runs_on_uvloop_as_the_served_gateway_does(redis_url: str) -> None:
    uvloop = pytest.importorskip("uvloop")

    async def ping() -> list[object]:
        connection = direct(redis_url)
        try:
            return await connection.exchange((("PING",), ("ECHO", "x")))
        finally:
            await connection.aclose()

    assert uvloop.run(ping()) == [b"PONG", b"x"]

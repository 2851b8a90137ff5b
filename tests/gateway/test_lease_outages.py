"""Leases and settles across Redis outages, on a redis-server of the test's own that goes
down (keeping its data) and comes back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
from opentelemetry.trace import INVALID_SPAN
from redis.asyncio import Redis
from redis.exceptions import RedisError

from gateway.call import Call
from gateway.canonical import Usage
from gateway.lease_book import LeaseBook
from gateway.leases import lease_hashes_key
from gateway.limits import Admission
from gateway.services import Services
from gateway.settle import settle
from tests.gateway.private_redis import PrivateRedis
from tests.gateway.test_leases import Replicas


@pytest.fixture
def private() -> Iterator[PrivateRedis]:
    server = PrivateRedis()
    server.start()
    yield server
    server.close()


@pytest.fixture
async def group(private: PrivateRedis) -> AsyncIterator[Replicas]:
    client = Redis.from_url(private.url)
    replicas = Replicas(client, private.url)
    yield replicas
    for book in replicas.books:
        await book.stop()
    await client.aclose()


def served_call(
    group: Replicas, book: LeaseBook, admission: Admission, usage: Usage, **fields: Any
) -> Call:
    """The request of ``admission``, answered on ``book``'s replica with ``usage``."""
    services = Services(
        settings=group.settings,
        router=None,  # type: ignore[arg-type]  # settling routes nothing
        limiter=group.limiter,
        recorder=group.recorder,
        redis=group.redis,
        leases=book,
    )
    now = time.perf_counter()
    return Call(
        services=services,
        key=group.key,
        route=None,  # type: ignore[arg-type]
        request=None,  # type: ignore[arg-type]
        admission=admission,
        request_id=admission.request_id,
        response_id="chatcmpl-" + admission.request_id,
        created=int(time.time()),
        public_model="m",
        prompt_estimate=5,
        prompt_param="messages",
        started=now,
        span=INVALID_SPAN,
        first_token_at=now,
        usage=usage,
        **fields,
    )


async def eventually(check: Callable[[], Awaitable[bool]], within_s: float, what: str) -> None:
    deadline = time.monotonic() + within_s
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def test_a_settle_redis_refused_lands_once_redis_is_back(
    private: PrivateRedis, group: Replicas
) -> None:
    """Redis is away for longer than the settle's own attempts: the request is not lost (its
    lease stays renewed, so it is neither unbilled nor left holding its reservation); the
    renewal loop settles it once Redis answers again."""
    book = group.book()
    admission = await group.admit(book)
    assert await group.budget_used() == 50
    await book.start()
    call = served_call(group, book, admission, Usage(5, 15), status="ok", finish_reason="stop")

    private.stop()
    await settle(call)
    private.start()

    async def settled() -> bool:
        return await group.budget_used() == 20

    await eventually(settled, group.settings.lease_s + 2, "the deferred settle")
    (event,) = await group.usage()
    assert (event.request_id, event.prompt_tokens, event.completion_tokens) == (
        admission.request_id,
        5,
        15,
    )
    assert event.status == "ok"
    assert not await group.stored(admission)
    assert await group.redis.zcard(admission.settle_keys[3]) == 0


async def test_an_admission_whose_lease_could_not_be_named_is_given_back(
    group: Replicas,
) -> None:
    """Redis booked the request, then refused to name the lease's hash (``opened`` raises, the
    request fails with a 503): the reservation, slot and lease go back at once, at zero."""
    book = group.book()
    draft = await book.draft(group.key, model="m", prompt_estimate=5, started_at=time.time())
    # The set of lease hashes can no longer be written (here: a key of the wrong type).
    hashes = lease_hashes_key(book.instance_id)
    await group.redis.delete(hashes)
    await group.redis.set(hashes, "not a set")
    admission = await group.limiter.admit(group.key, "r-1", 50, prompt_tokens=5, lease=draft)
    assert admission.new_epoch  # the key's first request: opened names every hash again
    assert await group.budget_used() == 50

    with pytest.raises(RedisError):
        await book.opened(draft, admission)
    assert await group.budget_used() == 0
    assert await group.redis.zcard(admission.settle_keys[3]) == 0
    assert not await group.stored(admission)
    (event,) = await group.usage()
    assert (event.request_id, event.prompt_tokens + event.completion_tokens) == ("r-1", 0)

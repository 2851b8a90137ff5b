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
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluicegate.gateway.admission.limits import Admission
from sluicegate.gateway.call.call import Call
from sluicegate.gateway.call.settle import settle
from sluicegate.gateway.canonical import Usage
from sluicegate.gateway.db.models import UsageDaily, UsageRecord
from sluicegate.gateway.leases.book import LeaseBook
from sluicegate.gateway.leases.lease import lease_hashes_key
from sluicegate.gateway.services import Services
from sluicegate.gateway.usage.stream import UsageFlusher
from tests.gateway.leases.test_leases import LEASE_S, Replicas
from tests.gateway.private_redis import PrivateRedis


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


async def renewed(book: LeaseBook) -> None:
    """Renew as the loop does: again while Redis refuses (a pooled connection it closed)."""
    for _ in range(20):
        try:
            await book.renew()
            return
        except RedisError:
            await asyncio.sleep(0.05)
    await book.renew()


async def test_after_an_outage_longer_than_a_lease_no_live_request_is_reaped(
    private: PrivateRedis, group: Replicas
) -> None:
    """Redis comes back (with its data) after more than a lease: every replica's entry is past
    its expiry. The first replica through must not take the others for dead before they had
    a lease's time to renew: their requests are running."""
    serving, peer = group.book(), group.book()
    admission = await group.admit(serving, tokens=1000)
    serving.progress(
        admission.request_id, prompt_tokens=5, delivered_tokens=115, first_token=True,
        deployment="d",
    )  # fmt: skip
    await serving.renew()
    await peer.renew()
    await asyncio.sleep(LEASE_S)  # the peer has been healthy for a lease: it may reap

    private.stop()
    for book in (serving, peer):
        with pytest.raises(RedisError):
            await book.renew()
    await asyncio.sleep(LEASE_S + 0.1)
    private.start()

    await renewed(peer)  # through first: it renews, and would reap the serving replica...
    assert await peer.reap() == 0
    await renewed(serving)  # ...which renews within a lease
    await asyncio.sleep(LEASE_S)
    await peer.renew()
    await serving.renew()
    assert await peer.reap() == 0
    assert await group.stored(admission)
    assert await group.usage() == []
    assert await group.limiter.settle(admission, 600)
    assert await group.budget_used() == 600


async def test_a_live_request_reaped_as_dead_is_corrected_by_its_own_settle(
    group: Replicas, db_sessionmaker: async_sessionmaker[AsyncSession]
) -> None:
    """A reaper settled a request of a replica it took for dead (a partition) from its last
    lease: 120 tokens. The replica was alive and served 600: its own settle corrects the
    budget by the difference, and its usage record raises the stored row and the rollup."""
    serving, reaper = group.book(), group.book()
    admission = await group.admit(serving, tokens=1000)
    serving.progress(
        admission.request_id, prompt_tokens=5, delivered_tokens=115, first_token=True,
        deployment="d",
    )  # fmt: skip
    await serving.renew()
    await renewed(reaper)
    await asyncio.sleep(LEASE_S)
    await group.die(serving)
    assert await reaper.reap() == 1
    assert await group.budget_used() == 120
    flusher = UsageFlusher(group.redis, db_sessionmaker, group.settings)
    await flusher.ensure_group()
    assert await flusher.flush_once() == 1

    call = served_call(group, serving, admission, Usage(5, 595), status="ok", finish_reason="stop")
    await settle(call)
    assert await group.budget_used() == 600
    assert await flusher.flush_once() == 1
    async with db_sessionmaker() as session:
        row = (
            await session.execute(
                select(UsageRecord).where(UsageRecord.request_id == admission.request_id)
            )
        ).scalar_one()
        daily = (await session.execute(select(UsageDaily))).scalars().all()
    assert (row.prompt_tokens, row.completion_tokens, row.status) == (5, 595, "ok")
    assert [(d.requests, d.prompt_tokens, d.completion_tokens, d.errors) for d in daily] == [
        (1, 5, 595, 0)
    ]
    # A replay of both records changes nothing.
    settled_again = served_call(group, serving, admission, Usage(5, 595), status="ok")
    await settle(settled_again)
    assert await group.budget_used() == 600

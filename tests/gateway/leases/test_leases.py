"""Leases on the real Redis: stored by the admission script, released by the settle script,
renewed without bringing back a settled request, and settled by another replica's reaper."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import msgspec
import pytest
from redis.asyncio import Redis

from sluicegate.engine import protocol, redis_names
from sluicegate.gateway.admission.limits import Admission, RateLimiter
from sluicegate.gateway.admission.scripts import EPOCH_TTL_S
from sluicegate.gateway.errors import RateLimited
from sluicegate.gateway.leases.book import LeaseBook
from sluicegate.gateway.leases.lease import lease_hashes_key
from sluicegate.gateway.providers.engine.replies import ReplyQueue, ReplyReader
from sluicegate.gateway.settings import Settings
from sluicegate.gateway.usage.stream import UsageEvent, UsageRecorder
from tests.gateway.key_records import key_record


@pytest.fixture
async def redis(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


LEASE_S = 0.5
"""Short, so that a reaper's wait to be healthy for a whole lease costs little."""


class Replicas:
    """Gateway replicas' lease books on one Redis and one usage stream, and what they wrote."""

    def __init__(self, redis: Redis, redis_url: str) -> None:
        self.redis = redis
        self.stream = f"sg:usage:test:{uuid.uuid4().hex[:10]}"
        self.settings = Settings(redis_url=redis_url, usage_stream=self.stream, lease_s=LEASE_S)
        self.limiter = RateLimiter(redis, slot_ttl_s=60)
        self.recorder = UsageRecorder(redis, self.settings)
        self.key = key_record(max_parallel_requests=2, token_budget=10_000)
        self.books: list[LeaseBook] = []

    def book(self) -> LeaseBook:
        settings = Settings(
            redis_url=self.settings.redis_url,
            usage_stream=self.stream,
            lease_s=LEASE_S,
            instance_id=uuid.uuid4().hex[:8],
        )
        book = LeaseBook(self.redis, settings, self.limiter, self.recorder)
        self.books.append(book)
        return book

    async def reaper(self) -> LeaseBook:
        """A replica that has reached Redis for a whole lease: it may reap."""
        book = self.book()
        await book.renew()
        await asyncio.sleep(book.lease_s)
        return book

    async def admit(self, book: LeaseBook, tokens: int = 50, max_completion: int = 0) -> Admission:
        draft = await book.draft(
            self.key,
            model="m",
            prompt_estimate=5,
            started_at=time.time(),
            max_completion=max_completion,
        )
        request_id = uuid.uuid4().hex
        admission = await self.limiter.admit(
            self.key, request_id, tokens, prompt_tokens=5, lease=draft
        )
        await book.opened(draft, admission)
        return admission

    async def budget_used(self) -> int:
        return (await self.limiter.counters("key", self.key, None))[0]

    async def stored(self, admission: Admission) -> bool:
        return bool(await self.redis.hexists(admission.settle_keys[-1], admission.request_id))

    async def usage(self) -> list[UsageEvent]:
        entries = await self.redis.xrange(self.stream)
        return [msgspec.json.decode(fields[b"e"], type=UsageEvent) for _, fields in entries]

    async def die(self, book: LeaseBook) -> None:
        """The replica stops renewing: its entry lapses (as ``lease_s`` after a SIGKILL)."""
        await self.redis.zadd(f"{self.stream}:replicas", {book.instance_id: time.time() - 1})

    async def close(self) -> None:
        names = [name async for name in self.redis.scan_iter(f"sg:rl:{{{self.key.id}}}*")]
        names += [lease_hashes_key(book.instance_id) for book in self.books]
        await self.redis.delete(*names, self.stream, f"{self.stream}:replicas")


@pytest.fixture
async def replicas(redis: Redis, redis_url: str) -> AsyncIterator[Replicas]:
    group = Replicas(redis, redis_url)
    yield group
    await group.close()


async def test_admission_stores_the_lease_and_the_first_settle_releases_it(
    replicas: Replicas,
) -> None:
    book = replicas.book()
    admission = await replicas.admit(book)
    assert await replicas.stored(admission)
    hashes = await replicas.redis.smembers(lease_hashes_key(book.instance_id))
    assert hashes == {admission.settle_keys[-1].encode()}
    assert await replicas.redis.zscore(f"{replicas.stream}:replicas", book.instance_id)
    assert await replicas.budget_used() == 50

    assert await replicas.limiter.settle(admission, 20) is True
    assert not await replicas.stored(admission)
    assert await replicas.budget_used() == 20
    # A second settle (a reaper that read the lease just before) changes nothing.
    assert await replicas.limiter.settle(admission, 20) is False
    assert await replicas.budget_used() == 20


async def test_a_dead_replicas_requests_are_settled_once_by_another(replicas: Replicas) -> None:
    victim, survivor = replicas.book(), await replicas.reaper()
    streamed = await replicas.admit(victim)
    silent = await replicas.admit(victim)
    victim.progress(
        streamed.request_id, prompt_tokens=9, delivered_tokens=7, first_token=True, deployment="d"
    )
    await victim.renew()
    await replicas.die(victim)

    assert await survivor.reap() == 2
    events = {event.request_id: event for event in await replicas.usage()}
    assert (
        events[streamed.request_id].prompt_tokens,
        events[streamed.request_id].completion_tokens,
    ) == (9, 7)
    assert events[streamed.request_id].status == "error"
    # Nothing reached the client of the other one: it is billed nothing.
    assert (
        events[silent.request_id].prompt_tokens + events[silent.request_id].completion_tokens == 0
    )
    assert await replicas.budget_used() == 16
    assert await replicas.redis.zcard(streamed.settle_keys[3]) == 0  # concurrency slots freed
    # The dead replica is forgotten with its leases; reaping again finds nothing.
    assert not await replicas.redis.exists(streamed.settle_keys[-1])
    assert not await replicas.redis.exists(lease_hashes_key(victim.instance_id))
    assert await replicas.redis.zscore(f"{replicas.stream}:replicas", victim.instance_id) is None
    assert await (await replicas.reaper()).reap() == 0
    assert len(await replicas.usage()) == 2


async def test_the_first_token_is_stored_before_any_renewal(replicas: Replicas) -> None:
    """From its first token a stream is billed if its replica dies, renewal or not; streams
    starting together are stored together."""
    victim, survivor = replicas.book(), await replicas.reaper()
    started = [await replicas.admit(victim) for _ in range(2)]
    for admission in started:
        victim.progress(
            admission.request_id, prompt_tokens=9, delivered_tokens=1, first_token=True,
            deployment="d",
        )  # fmt: skip
    for _ in range(200):
        if victim._storing is None:
            break
        await asyncio.sleep(0.01)
    await replicas.die(victim)

    assert await survivor.reap() == 2
    usage = [(e.prompt_tokens, e.completion_tokens) for e in await replicas.usage()]
    assert usage == [(9, 1)] * 2


async def test_renewals_never_bring_back_a_settled_lease(replicas: Replicas) -> None:
    book = replicas.book()
    admission = await replicas.admit(book)
    # Settled between the renewal's snapshot of the leases and its write.
    assert await replicas.limiter.settle(admission, 10)
    await book.renew()
    assert not await replicas.stored(admission)
    await replicas.die(book)
    assert await (await replicas.reaper()).reap() == 0
    assert await replicas.budget_used() == 10


async def test_a_lease_redis_lost_is_put_back_and_settled_in_full_once(
    replicas: Replicas,
) -> None:
    book = replicas.book()
    admission = await replicas.admit(book)
    book.progress(
        admission.request_id, prompt_tokens=5, delivered_tokens=3, first_token=True, deployment="d"
    )
    # Redis restarts empty; the budget counter is re-seeded from the database (100 earlier).
    names = [name async for name in replicas.redis.scan_iter(f"sg:rl:{{{replicas.key.id}}}*")]
    await replicas.redis.delete(*names)
    await replicas.redis.set(admission.settle_keys[1], 100)
    await book.renew()
    assert await replicas.stored(admission)

    await replicas.die(book)
    assert await (await replicas.reaper()).reap() == 1
    assert await replicas.budget_used() == 100 + 8
    # The replica was only paused: its own settle afterwards counts nothing twice.
    assert await replicas.limiter.settle(admission, 8) is False
    assert await replicas.budget_used() == 100 + 8


async def test_a_live_request_keeps_its_slot_and_reservation_past_the_slot_ttl(
    replicas: Replicas,
) -> None:
    """A request that runs longer than its slot's ttl (request timeout + margin) while its
    replica renews keeps its concurrency slot and its held marker: max_parallel_requests
    still holds, and its settle still corrects the reservation."""
    book = replicas.book()
    live = await replicas.admit(book)
    held, slots = live.settle_keys[-3], live.settle_keys[3]
    # It has run almost to the end of its slot's ttl: marker and slot lapse in 0.3 s...
    await replicas.redis.pexpire(held, 300)
    await replicas.redis.zadd(slots, {live.request_id: time.time() + 0.3})
    await book.renew()  # ...but its replica renews it.
    await asyncio.sleep(0.4)

    other = await replicas.admit(book)
    with pytest.raises(RateLimited):  # two at a time, both still running
        await replicas.admit(book)
    assert await replicas.limiter.settle(live, 20)
    assert await replicas.budget_used() == 20 + 50  # and the other one's reservation
    assert await replicas.limiter.settle(other, 30)
    assert await replicas.budget_used() == 20 + 30


async def test_a_keys_epoch_lives_as_long_as_its_requests_not_forever(replicas: Replicas) -> None:
    book = replicas.book()
    admission = await replicas.admit(book)
    epoch = admission.settle_keys[-2]
    assert 0 < await replicas.redis.ttl(epoch) <= EPOCH_TTL_S
    # Each admission of the key, and each renewal of its leases, gives it a whole ttl again.
    await replicas.redis.expire(epoch, 100)
    await replicas.admit(book)
    assert await replicas.redis.ttl(epoch) > EPOCH_TTL_S - 10
    await replicas.redis.expire(epoch, 100)
    await book.renew()
    assert await replicas.redis.ttl(epoch) > EPOCH_TTL_S - 10


async def test_a_hash_that_holds_no_leases_leaves_the_replicas_set(replicas: Replicas) -> None:
    """One lease hash per API key served: without leases for a while it is no longer named
    (nor renewed), so the set does not grow with every key ever served. The key's next
    request names it again, and a reaper finds that request's lease."""
    book = LeaseBook(
        replicas.redis, replicas.settings, replicas.limiter, replicas.recorder, hash_idle_s=0.2
    )
    replicas.books.append(book)
    hashes = lease_hashes_key(book.instance_id)
    done = await replicas.admit(book)
    assert await replicas.limiter.settle(done, 10)
    book.forget(done.request_id)
    await book.renew()
    assert await replicas.redis.smembers(hashes) == {done.settle_keys[-1].encode()}
    await asyncio.sleep(0.3)
    await book.renew()
    assert await replicas.redis.smembers(hashes) == set()

    again = await replicas.admit(book)
    assert await replicas.redis.smembers(hashes) == {again.settle_keys[-1].encode()}
    await asyncio.sleep(0.3)
    await book.renew()  # it holds a lease: it stays
    assert await replicas.redis.smembers(hashes) == {again.settle_keys[-1].encode()}
    await replicas.die(book)
    assert await (await replicas.reaper()).reap() == 1


async def test_a_reaped_stream_is_billed_what_reached_its_client_not_what_the_engine_made(
    replicas: Replicas,
) -> None:
    """The engine went on after the replica died (50 tokens by the time the reaper looked);
    the client got the 7 of the replica's last lease write. It is billed those 7, with the
    engine's exact prompt count, and the generation nobody reads is cancelled."""
    victim = replicas.book()
    streamed = await replicas.admit(victim)
    victim.progress(
        streamed.request_id, prompt_tokens=5, delivered_tokens=7, first_token=True, deployment="d"
    )
    await victim.renew()
    produced = redis_names.produced_key(streamed.request_id)
    await replicas.redis.hset(produced, mapping={"n": 50, "p": 12, "d": 0, "m": "lf-model"})
    cancels = replicas.redis.pubsub()
    await cancels.subscribe(redis_names.cancel_channel("lf-model"))
    try:
        await replicas.die(victim)
        assert await (await replicas.reaper()).reap() == 1
        (event,) = await replicas.usage()
        assert (event.prompt_tokens, event.completion_tokens) == (12, 7)
        assert await replicas.budget_used() == 19
        message = None
        for _ in range(20):
            message = await cancels.get_message(ignore_subscribe_messages=True, timeout=0.1)
            if message is not None:
                break
        assert message is not None
        assert protocol.decode(message["data"]) == protocol.Cancel(streamed.request_id)
    finally:
        await cancels.aclose()
        await replicas.redis.delete(produced)


# ---- billed up to what the dead replica had read -------------------------------------------


def _delta(request_id: str, produced: int, seq: int = 0) -> protocol.Delta:
    return protocol.Delta(
        request_id, seq, text=f"t{produced}", token_ids=[produced], produced=produced
    )


class ReplyStream:
    """A replica's reply stream with its real reader, and a worker's writes to it."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self.name = redis_names.reply_stream(f"gw-test-{uuid.uuid4().hex[:8]}")
        self.reader = ReplyReader(redis, self.name, block_ms=100)

    async def write(self, *deltas: protocol.Delta) -> None:
        """One entry, as a worker writes one step's replies (a Batch when several)."""
        message = protocol.Batch(list(deltas)) if len(deltas) > 1 else deltas[0]
        await self.redis.xadd(self.name, {redis_names.MESSAGE_FIELD: protocol.encode(message)})

    def lease_write(self, replica: LeaseBook, request_id: str, delivered: int) -> None:
        """What ``replica``'s next lease write says of a stream read from here."""
        replica.progress(
            request_id, prompt_tokens=5, delivered_tokens=delivered, first_token=True,
            deployment="d", reply_to=self.name,
        )  # fmt: skip

    async def received(self, queue: ReplyQueue, produced: int) -> None:
        """Wait until the reader handed over the delta that brought the request to
        ``produced``: it has read the entry holding it."""
        while True:
            delta = await asyncio.wait_for(queue.get(), 5)
            if isinstance(delta, protocol.Delta) and delta.produced == produced:
                return

    async def close(self) -> None:
        await self.reader.aclose()
        await self.redis.delete(self.name)


@pytest.fixture
async def replies(redis: Redis) -> AsyncIterator[ReplyStream]:
    stream = ReplyStream(redis)
    yield stream
    await stream.close()


async def test_a_reaped_stream_is_billed_up_to_what_its_replica_had_read(
    replicas: Replicas, replies: ReplyStream
) -> None:
    """The replica's last lease write said 2 tokens; it read on to the 6th (the last two in a
    resumed attempt after a worker died, in a Batch with another request's delta) and died;
    the worker wrote 4 more nobody read, and the engine's count is higher still. Billed: the
    6 read, not the lease's 2, not the 10 written nor the engine's 50."""
    victim = replicas.book()
    streamed = await replicas.admit(victim, max_completion=64)
    rid = streamed.request_id
    queue = replies.reader.open(rid)
    await replies.write(_delta(rid, 1, 0))
    await replies.write(_delta(rid, 2, 1))
    await replies.received(queue, 2)
    replies.lease_write(victim, rid, 2)
    await victim.renew()  # the lease's last write: 2 tokens
    await replies.write(_delta(rid, 3, 2))
    await replies.write(_delta(rid, 4, 3))
    await replies.received(queue, 4)
    resumed = redis_names.attempt_id(rid, 1)
    queue = replies.reader.open(resumed)
    await replies.write(_delta(resumed, 5, 0), _delta("someone-else", 99))
    await replies.write(_delta(resumed, 6, 1))
    await replies.received(queue, 6)
    await replies.reader.aclose()  # the replica dies: nothing more is read
    for produced in range(7, 11):
        await replies.write(_delta(resumed, produced, produced - 5))
    engine = redis_names.produced_key(rid)
    await replicas.redis.hset(engine, mapping={"n": 50, "p": 12, "d": 0, "m": "lf-model"})
    try:
        await replicas.die(victim)
        assert await (await replicas.reaper()).reap() == 1
    finally:
        await replicas.redis.delete(engine)
    (event,) = await replicas.usage()
    assert (event.prompt_tokens, event.completion_tokens) == (12, 6)
    assert await replicas.budget_used() == 18


async def test_a_reaped_stream_is_billed_at_most_its_max_tokens_and_never_below_its_lease(
    replicas: Replicas, replies: ReplyStream
) -> None:
    victim = replicas.book()
    capped = await replicas.admit(victim, max_completion=3)
    ahead = await replicas.admit(victim, max_completion=64)
    for admission in (capped, ahead):
        queue = replies.reader.open(admission.request_id)
        await replies.write(_delta(admission.request_id, 5))
        await replies.received(queue, 5)
    replies.lease_write(victim, capped.request_id, 1)
    # A lease that counted more than the deltas say (a worker before Delta.produced, say).
    replies.lease_write(victim, ahead.request_id, 9)
    await victim.renew()
    await replicas.die(victim)
    assert await (await replicas.reaper()).reap() == 2
    billed = {e.request_id: e.completion_tokens for e in await replicas.usage()}
    assert billed == {capped.request_id: 3, ahead.request_id: 9}


async def test_trimmed_deltas_fall_back_to_the_leases_count(
    replicas: Replicas, replies: ReplyStream, caplog: pytest.LogCaptureFixture
) -> None:
    victim = replicas.book()
    streamed = await replicas.admit(victim, max_completion=64)
    rid = streamed.request_id
    queue = replies.reader.open(rid)
    for produced in range(1, 5):
        await replies.write(_delta(rid, produced, produced - 1))
    await replies.received(queue, 4)
    replies.lease_write(victim, rid, 3)
    await victim.renew()
    other = replies.reader.open("someone-else")
    await replies.write(_delta("someone-else", 1))
    await replies.received(other, 1)
    await replies.reader.aclose()
    # MAXLEN trimmed the stream down to its last entry, another request's.
    await replicas.redis.xtrim(replies.name, maxlen=1, approximate=False)
    await replicas.die(victim)
    with caplog.at_level("WARNING", logger="sluicegate.gateway.leases.reaper"):
        assert await (await replicas.reaper()).reap() == 1
    (event,) = await replicas.usage()
    assert event.completion_tokens == 3
    assert any(rid in r.getMessage() and "trimmed" in r.getMessage() for r in caplog.records)


async def test_a_reply_stream_deleted_and_recreated_by_a_workers_reply(
    replicas: Replicas, replies: ReplyStream
) -> None:
    """Workers let an idle reply stream expire; a later reply's XADD makes it again, without
    the reader's group. The reader's next read answers NOGROUP: it makes the group again at
    id 0, so it reads that reply too, and the reaper bills by the new group's position. A
    stream recreated that the replica never read again has no group: the lease's count."""
    victim = replicas.book()
    read_again = await replicas.admit(victim, max_completion=64)
    rid = read_again.request_id
    queue = replies.reader.open(rid)
    await replies.write(_delta(rid, 1, 0))
    await replies.write(_delta(rid, 2, 1))
    await replies.received(queue, 2)
    replies.lease_write(victim, rid, 1)
    await victim.renew()
    await replicas.redis.delete(replies.name)  # expired
    await replies.write(_delta(rid, 3, 2))  # a worker's reply creates it again
    await replies.received(queue, 3)
    groups = await replicas.redis.xinfo_groups(replies.name)
    assert [g["name"] for g in groups] == [b"gateway"]
    await replies.reader.aclose()

    # A second replica's stream, recreated after it had read, never read again.
    lost = ReplyStream(replicas.redis)
    try:
        victim_b = replicas.book()
        unread = await replicas.admit(victim_b, max_completion=64)
        queue_b = lost.reader.open(unread.request_id)
        await lost.write(_delta(unread.request_id, 4))
        await lost.received(queue_b, 4)
        victim_b.progress(
            unread.request_id, prompt_tokens=5, delivered_tokens=2, first_token=True,
            deployment="d", reply_to=lost.name,
        )  # fmt: skip
        await victim_b.renew()
        await lost.reader.aclose()
        await replicas.redis.delete(lost.name)
        await lost.write(_delta(unread.request_id, 7))
        await replicas.die(victim)
        await replicas.die(victim_b)
        assert await (await replicas.reaper()).reap() == 2
    finally:
        await lost.close()
    billed = {e.request_id: e.completion_tokens for e in await replicas.usage()}
    assert billed == {rid: 3, unread.request_id: 2}

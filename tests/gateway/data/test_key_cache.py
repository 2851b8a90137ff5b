"""KeyCache: dict hits once cached, revocation/expiry on every replica within one second."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from redis.asyncio import Redis
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluicegate.gateway.db import keys as key_queries
from sluicegate.gateway.db.session import create_engine, create_sessionmaker
from sluicegate.gateway.errors import AuthenticationFailed, RateLimited, ServiceUnavailable
from sluicegate.gateway.keys.cache import KeyCache, publish_invalidation
from sluicegate.gateway.keys.records import generate_key
from sluicegate.gateway.settings import Settings


async def _new_key(
    sessionmaker: async_sessionmaker[AsyncSession], **fields: Any
) -> tuple[str, str]:
    plaintext, key_hash, prefix = generate_key()
    async with sessionmaker() as session, session.begin():
        row = await key_queries.create_key(
            session, name="k", key_hash=key_hash, key_prefix=prefix, **fields
        )
    return plaintext, str(row.id)


async def _rejected(cache: KeyCache, plaintext: str) -> bool:
    try:
        await cache.lookup(plaintext)
    except AuthenticationFailed:
        return True
    return False


@pytest.fixture
async def second_cache(
    gateway_settings: Settings, db_sessionmaker: async_sessionmaker[AsyncSession]
) -> AsyncIterator[KeyCache]:
    """Another replica: its own Redis connection pool, same Redis and database."""
    redis = Redis.from_url(gateway_settings.redis_url)
    cache = KeyCache(redis, db_sessionmaker, gateway_settings)
    await cache.start()
    yield cache
    await cache.stop()
    await redis.aclose()


@contextlib.contextmanager
def _counting_statements(sessionmaker: async_sessionmaker[AsyncSession]) -> Iterator[list[str]]:
    statements: list[str] = []
    engine = sessionmaker.kw["bind"].sync_engine

    def count(*args: Any) -> None:
        statements.append(args[2])

    event.listen(engine, "before_cursor_execute", count)
    try:
        yield statements
    finally:
        event.remove(engine, "before_cursor_execute", count)


async def test_cached_lookup_makes_no_database_round_trip(
    key_cache: KeyCache, db_sessionmaker: async_sessionmaker[AsyncSession]
) -> None:
    plaintext, key_id = await _new_key(db_sessionmaker, allowed_models=["m"], rpm_limit=5)
    with _counting_statements(db_sessionmaker) as statements:
        records = await asyncio.gather(*(key_cache.lookup(plaintext) for _ in range(20)))
        assert len(statements) == 1, "concurrent misses share one query"
        for _ in range(200):
            await key_cache.lookup(plaintext)
        assert len(statements) == 1
    record = records[0]
    assert record.id == key_id and record.rpm_limit == 5
    assert record.allows_model("m") and not record.allows_model("other")


async def test_a_wrong_key_retried_in_a_loop_costs_one_query(
    key_cache: KeyCache, db_sessionmaker: async_sessionmaker[AsyncSession]
) -> None:
    wrong = generate_key()[0]
    with _counting_statements(db_sessionmaker) as statements:
        for _ in range(50):
            with pytest.raises(AuthenticationFailed):
                await key_cache.lookup(wrong)
    assert len(statements) == 1


async def test_revocation_reaches_every_replica_within_one_second(
    key_cache: KeyCache,
    second_cache: KeyCache,
    redis_client: Redis,
    db_sessionmaker: async_sessionmaker[AsyncSession],
) -> None:
    plaintext, key_id = await _new_key(db_sessionmaker)
    other_plaintext, _ = await _new_key(db_sessionmaker)
    for cache in (key_cache, second_cache):
        await cache.lookup(plaintext)
        await cache.lookup(other_plaintext)

    async with db_sessionmaker() as session, session.begin():
        await key_queries.revoke_key(session, key_id)
    await publish_invalidation(redis_client, key_id)
    revoked_at = time.monotonic()
    pending = {key_cache, second_cache}
    while pending and time.monotonic() - revoked_at < 2.0:
        pending = {cache for cache in pending if not await _rejected(cache, plaintext)}
        await asyncio.sleep(0.005)
    elapsed = time.monotonic() - revoked_at
    assert not pending, "a replica still accepts the revoked key"
    assert elapsed < 1.0
    for cache in (key_cache, second_cache):
        assert (await cache.lookup(other_plaintext)).name == "k", "other keys stay valid"


async def test_edits_reach_cached_replicas(
    key_cache: KeyCache, redis_client: Redis, db_sessionmaker: async_sessionmaker[AsyncSession]
) -> None:
    plaintext, key_id = await _new_key(db_sessionmaker, rpm_limit=5)
    assert (await key_cache.lookup(plaintext)).rpm_limit == 5
    async with db_sessionmaker() as session, session.begin():
        await key_queries.update_key(session, key_id, {"rpm_limit": 9})
    await publish_invalidation(redis_client, key_id)
    deadline = time.monotonic() + 1.0
    while (await key_cache.lookup(plaintext)).rpm_limit != 9:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.005)


async def test_unknown_revoked_and_expired_keys_are_rejected(
    key_cache: KeyCache, db_sessionmaker: async_sessionmaker[AsyncSession]
) -> None:
    now = dt.datetime.now(dt.UTC)
    expired, _ = await _new_key(db_sessionmaker, expires_at=now - dt.timedelta(seconds=1))
    expiring, _ = await _new_key(db_sessionmaker, expires_at=now + dt.timedelta(seconds=0.5))
    revoked, revoked_id = await _new_key(db_sessionmaker)
    async with db_sessionmaker() as session, session.begin():
        await key_queries.revoke_key(session, revoked_id)

    for plaintext in (expired, revoked, generate_key()[0], "not-a-key", ""):
        with pytest.raises(AuthenticationFailed):
            await key_cache.lookup(plaintext)

    await key_cache.lookup(expiring)
    await asyncio.sleep(
        max(0.0, (now + dt.timedelta(seconds=0.5) - dt.datetime.now(dt.UTC)).total_seconds()) + 0.05
    )
    with pytest.raises(AuthenticationFailed, match="expired"):
        await key_cache.lookup(expiring)


async def test_cached_keys_survive_a_database_outage_and_revocations_still_apply(
    gateway_settings: Settings,
    redis_client: Redis,
    db_sessionmaker: async_sessionmaker[AsyncSession],
    db_proxy: Any,
) -> None:
    kept, _ = await _new_key(db_sessionmaker)
    revoked, revoked_id = await _new_key(db_sessionmaker)
    never_seen, _ = await _new_key(db_sessionmaker)
    engine = create_engine(db_proxy.url)
    settings = dataclasses.replace(gateway_settings, key_cache_ttl_s=0.05)
    cache = KeyCache(redis_client, create_sessionmaker(engine), settings)
    await cache.start()
    try:
        await cache.lookup(kept)
        await cache.lookup(revoked)
        await db_proxy.stop()
        await asyncio.sleep(0.1)  # past the TTL: every lookup now tries the database first

        assert (await cache.lookup(kept)).name == "k"
        with pytest.raises(ServiceUnavailable):
            await cache.lookup(never_seen)
        await publish_invalidation(redis_client, revoked_id)
        deadline = time.monotonic() + 1.0
        while True:
            try:
                await cache.lookup(revoked)
            except ServiceUnavailable:
                break
            assert time.monotonic() < deadline, "an invalidated key must not be served stale"
            await asyncio.sleep(0.005)

        await db_proxy.start()
        assert (await cache.lookup(never_seen)).name == "k"
    finally:
        await cache.stop()
        await engine.dispose()


async def test_malformed_tokens_are_refused_without_a_query(
    key_cache: KeyCache, db_sessionmaker: async_sessionmaker[AsyncSession]
) -> None:
    well_formed = generate_key()[0]
    with _counting_statements(db_sessionmaker) as statements:
        for token in [
            "sk-short",
            well_formed + "x",
            well_formed[:-1] + "!",
            "pk-" + well_formed[3:],
        ]:
            with pytest.raises(AuthenticationFailed):
                await key_cache.lookup(token, "10.0.0.1")
    assert statements == []


async def test_unknown_keys_are_throttled_per_client_address_before_any_query(
    gateway_settings: Settings,
    redis_client: Redis,
    db_sessionmaker: async_sessionmaker[AsyncSession],
) -> None:
    settings = dataclasses.replace(gateway_settings, invalid_key_lookups_per_min=3)
    cache = KeyCache(redis_client, db_sessionmaker, settings)
    await cache.start()
    good, _ = await _new_key(db_sessionmaker)
    try:
        with _counting_statements(db_sessionmaker) as statements:
            for _ in range(3):
                with pytest.raises(AuthenticationFailed):
                    await cache.lookup(generate_key()[0], "10.0.0.1")
            assert len(statements) == 3
            for _ in range(20):
                with pytest.raises(RateLimited) as limited:
                    await cache.lookup(generate_key()[0], "10.0.0.1")
            assert len(statements) == 3, "a throttled address reaches the database no more"
            assert limited.value.status_code == 429
            assert 1 <= int(limited.value.headers["retry-after"]) <= 60
            with pytest.raises(AuthenticationFailed):
                await cache.lookup(generate_key()[0], "10.0.0.2")
            assert len(statements) == 4, "other addresses are not affected"
            assert (await cache.lookup(good, "10.0.0.2")).name == "k"
            assert (await cache.lookup(good, "10.0.0.1")).name == "k", "cached keys still work"
    finally:
        await cache.stop()

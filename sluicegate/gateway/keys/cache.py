"""The per-replica key cache: key hash -> ``ApiKeyRecord``, kept honest over Redis pub/sub.

``KeyCache.lookup`` answers from a dict once a key is cached (no database round trip), and
every replica drops a key within milliseconds of a ``publish_invalidation`` on the Redis
channel ``sg:keys:invalidate`` (revocation, edits). Entries also expire after
``key_cache_ttl_s`` as a backstop for a missed message, and the whole cache is dropped whenever
the subscription is lost, since messages may have been missed then. While PostgreSQL is down,
cached keys keep working; keys not cached get a 503. A key the database did not know is
remembered as unknown, and each client address may cause only
``invalid_key_lookups_per_min`` such misses per minute (``sluicegate.gateway.keys.throttle``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from redis.asyncio import Redis
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from sluicegate.gateway.db import keys as key_queries
from sluicegate.gateway.errors import AuthenticationFailed, RateLimited, ServiceUnavailable
from sluicegate.gateway.keys.records import KEY_SHAPE, ApiKeyRecord, hash_key
from sluicegate.gateway.keys.throttle import FailureThrottle
from sluicegate.gateway.settings import Settings

logger = logging.getLogger(__name__)

INVALIDATION_CHANNEL = "sg:keys:invalidate"
STALE_RETRY_S = 1.0
"""How long a cached key is served as-is after its refresh failed, before trying again."""
UNKNOWN_KEYS_CACHED = 10_000
INVALIDATE_ALL = "*"
"""Payload that drops every cached key (e.g. after a bulk change)."""


@dataclass(slots=True)
class _Entry:
    record: ApiKeyRecord
    fresh_until: float
    """time.monotonic() after which the database is asked again."""
    expires_ts: float | None
    """The key's own expiry as a Unix timestamp, checked on every lookup."""


def _entry(record: ApiKeyRecord, ttl_s: float) -> _Entry:
    expires_ts = record.expires_at.timestamp() if record.expires_at is not None else None
    return _Entry(record, time.monotonic() + ttl_s, expires_ts)


async def publish_invalidation(redis: Redis, *key_ids: str) -> None:
    """Tells every replica's KeyCache to forget these keys (after a revoke or an edit)."""
    for key_id in key_ids:
        await redis.publish(INVALIDATION_CHANNEL, key_id)


class KeyCache:
    """In-process cache of key hash -> ApiKeyRecord, kept honest over Redis pub/sub."""

    def __init__(
        self,
        redis: Redis,
        sessionmaker: async_sessionmaker[AsyncSession],
        settings: Settings,
        *,
        channel: str = INVALIDATION_CHANNEL,
    ) -> None:
        self._redis = redis
        self._sessionmaker = sessionmaker
        self._ttl_s = settings.key_cache_ttl_s
        self._channel = channel
        self._entries: dict[str, _Entry] = {}
        self._hashes_by_id: dict[str, set[str]] = {}
        """A rotated key has two live hashes until its grace period ends."""
        self._unknown: dict[str, float] = {}
        """Hashes the database did not know -> monotonic time until which that is trusted."""
        self._loading: dict[str, asyncio.Future[_Entry | None]] = {}
        self._throttle = FailureThrottle(settings.invalid_key_lookups_per_min)
        self._epoch = 0
        """Bumped on every invalidation, so a load that raced one is not cached."""
        self._subscribed = False
        self._ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self, timeout_s: float = 5.0) -> None:
        """Subscribes to invalidations; until subscribed, lookups always ask the database."""
        self._task = asyncio.create_task(self._listen(), name="key-cache-invalidations")
        try:
            await asyncio.wait_for(self._ready.wait(), timeout_s)
        except TimeoutError:
            logger.warning(
                "key cache not subscribed after %.1fs; retrying in background", timeout_s
            )

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.invalidate_all()

    async def lookup(self, plaintext: str, client: str = "") -> ApiKeyRecord:
        """The key's record; ``client`` (the caller's address) is throttled on unknown keys."""
        if not KEY_SHAPE.fullmatch(plaintext):
            raise AuthenticationFailed("Incorrect API key provided.")
        digest = hash_key(plaintext)
        entry = self._entries.get(digest)
        if entry is None or time.monotonic() >= entry.fresh_until:
            if entry is None:
                self._refuse_unasked(digest, client)
            entry = await self._refresh(digest, entry, client)
        return _usable(entry)

    def cached(self, plaintext: str) -> ApiKeyRecord | None:
        """The record of a key cached and fresh, without awaiting anything (the request
        path's common case); None when ``lookup`` must ask the database."""
        if not KEY_SHAPE.fullmatch(plaintext):
            raise AuthenticationFailed("Incorrect API key provided.")
        entry = self._entries.get(hash_key(plaintext))
        if entry is None or time.monotonic() >= entry.fresh_until:
            return None
        return _usable(entry)

    def invalidate(self, key_id: str) -> None:
        self._epoch += 1
        if key_id == INVALIDATE_ALL:
            self.invalidate_all()
            return
        for digest in self._hashes_by_id.pop(key_id, ()):
            self._entries.pop(digest, None)

    def invalidate_all(self) -> None:
        self._epoch += 1
        self._entries.clear()
        self._hashes_by_id.clear()

    def _refuse_unasked(self, digest: str, client: str) -> None:
        """Raises, without a database query, for a known-unknown key or a throttled client."""
        if self._unknown.get(digest, 0.0) > time.monotonic():
            raise AuthenticationFailed("Incorrect API key provided.")
        retry_after = self._throttle.retry_after(client)
        if retry_after is not None:
            raise RateLimited(
                "Too many requests with invalid API keys from this address; try again later.",
                limit="requests",
                retry_after_s=retry_after,
                code="invalid_api_key_rate_limited",
            )

    async def _refresh(self, digest: str, stale: _Entry | None, client: str = "") -> _Entry:
        try:
            entry = await self._load(digest)
        except Exception as exc:
            # While subscribed, a stale entry has missed no revocation: keep serving it
            # through a database outage rather than failing every request.
            if stale is not None and self._subscribed:
                logger.warning("key lookup failed (%s); serving the cached record", exc)
                stale.fresh_until = time.monotonic() + STALE_RETRY_S
                return stale
            raise ServiceUnavailable("The API key cannot be verified right now.") from exc
        if entry is None:
            self._remember_unknown(digest)
            self._throttle.record_failure(client)
            raise AuthenticationFailed("Incorrect API key provided.")
        return entry

    def _remember_unknown(self, digest: str) -> None:
        # Safe to cache: a key is random, so nobody presents it before it is created.
        # This spares the database a client that retries a wrong key in a loop.
        if len(self._unknown) >= UNKNOWN_KEYS_CACHED:
            del self._unknown[next(iter(self._unknown))]
        self._unknown[digest] = time.monotonic() + self._ttl_s

    async def _load(self, digest: str) -> _Entry | None:
        # One database query per key however many requests wait on it; shielded so that a
        # client that disconnects does not cancel the load for the others.
        future = self._loading.get(digest)
        if future is None:
            future = asyncio.ensure_future(self._fetch(digest))
            self._loading[digest] = future
            future.add_done_callback(lambda _: self._loading.pop(digest, None))
        return await asyncio.shield(future)

    async def _fetch(self, digest: str) -> _Entry | None:
        epoch = self._epoch
        async with self._sessionmaker() as session:
            found = await key_queries.find_by_hash(session, digest)
        if found is None:
            return None
        row, team = found
        # A secret replaced by a rotation works until its grace period ends, then expires
        # on every replica by itself (and at once on an invalidation).
        grace_end = row.previous_key_expires_at if row.key_hash != digest else None
        if grace_end is not None and row.expires_at is not None:
            grace_end = min(grace_end, row.expires_at)
        entry = _entry(ApiKeyRecord.from_row(row, team, expires_at=grace_end), self._ttl_s)
        if self._subscribed and epoch == self._epoch:
            self._entries[digest] = entry
            self._hashes_by_id.setdefault(entry.record.id, set()).add(digest)
        return entry

    async def _listen(self) -> None:
        backoff_s = 0.1
        while True:
            pubsub = self._redis.pubsub()
            try:
                await pubsub.subscribe(self._channel)
                async for message in pubsub.listen():
                    kind = _text(message["type"])
                    if kind == "subscribe":
                        # Anything cached before this moment may have missed a message.
                        self.invalidate_all()
                        self._subscribed = True
                        self._ready.set()
                        backoff_s = 0.1
                    elif kind == "message":
                        self.invalidate(_text(message["data"]))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                logger.warning("key invalidation subscription lost: %s", exc)
            finally:
                self._subscribed = False
                self.invalidate_all()
                with contextlib.suppress(Exception):
                    await asyncio.shield(pubsub.aclose())
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, 2.0)


def _usable(entry: _Entry) -> ApiKeyRecord:
    if entry.record.revoked:
        raise AuthenticationFailed("This API key has been revoked.")
    if entry.expires_ts is not None and time.time() >= entry.expires_ts:
        raise AuthenticationFailed("This API key has expired.")
    return entry.record


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value

"""This replica's side of the leases (``sluicegate.gateway.leases.lease``): a draft for each admission, the
renewals, and the background task that renews and reaps."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import RedisError

from sluicegate.gateway.admission.limits import Admission, KeyLimits, RateLimiter
from sluicegate.gateway.leases.lease import (
    ALIVE_LUA,
    RENEW_LUA,
    Lease,
    LeaseDraft,
    lease_hash_key,
    lease_hashes_key,
    renew_call,
    replicas_key,
)
from sluicegate.gateway.leases.reaper import LeaseReaper
from sluicegate.gateway.settings import Settings
from sluicegate.gateway.usage.stream import UsageRecorder

logger = logging.getLogger(__name__)

_REAP_EVERY_S = 1.0

HASH_IDLE_S = 300.0
"""A lease hash (one per API key served) that held none of this replica's leases for this
long leaves its set and its renewals, or both would grow with every key ever served. The
key's next request here names it again (one round trip, as for its first)."""

SETTLE_RETRY_LIMIT_S = 3600.0
"""How long a settle that failed (Redis unreachable) is retried from the renewal loop before
it is given up with an error (its lease stays stored: a peer settles it once this replica
stops). Retries run only after a renewal succeeded, so this is an hour of Redis answering
renewals but not this settle: something other than an outage is broken."""


@dataclass(slots=True)
class _PendingSettle:
    attempt: Callable[[], Awaitable[None]]
    since: float


class LeaseBook:
    """This replica's leases: stored by admission, renewed in bulk, released by settlement;
    and the background task that renews them and reaps replicas that died."""

    def __init__(
        self,
        redis: Redis,
        settings: Settings,
        limiter: RateLimiter,
        recorder: UsageRecorder,
        *,
        hash_idle_s: float = HASH_IDLE_S,
    ) -> None:
        self._redis = redis
        self._limiter = limiter
        self._recorder = recorder
        self.instance_id = settings.instance_id
        self.lease_s = settings.lease_s
        self._hashes_key = lease_hashes_key(self.instance_id)
        self._replicas = replicas_key(settings.usage_stream)
        self._leases: dict[str, Lease] = {}
        self._hashes: dict[str, float] = {}
        """Lease hashes this replica named in its set (and so may store leases in), with when
        (monotonic) each was last used."""
        self._hash_idle_s = hash_idle_s
        self._naming = asyncio.Lock()
        """Held while hashes are named or dropped, so a hash named again is never dropped by a
        renewal's SREM that reaches Redis after the naming SADD."""
        self._healthy_since: float | None = None
        """Since when (monotonic) every renewal and reap reached Redis; None after a failure."""
        self._pending: dict[str, _PendingSettle] = {}
        """Requests whose settle failed (Redis unreachable): retried by the renewal loop."""
        self._task: asyncio.Task[None] | None = None
        self._first_tokens: list[Lease] = []
        """Leases whose first token went out, to store at once (``_store_first_tokens``)."""
        self._storing: asyncio.Task[None] | None = None
        self._reaper = LeaseReaper(redis, self.instance_id, self._replicas, limiter, recorder)

    @property
    def reaped(self) -> int:
        return self._reaper.reaped

    # ---- this replica's leases -------------------------------------------------------------

    async def draft(
        self,
        key: KeyLimits,
        *,
        model: str,
        prompt_estimate: int,
        started_at: float,
        max_completion: int = 0,
        adapter: str | None = None,
    ) -> LeaseDraft:
        """The lease the admission of a request of ``key`` will store. The first time this
        replica uses the key's hash, it names it in its set first, so a reaper finds it."""
        hash_key = lease_hash_key(key, self.instance_id)
        if hash_key not in self._hashes:
            async with self._naming:
                await self._name_hashes([hash_key])
        self._hashes[hash_key] = time.monotonic()
        return LeaseDraft(hash_key, model, prompt_estimate, started_at, max_completion, adapter)

    async def opened(self, draft: LeaseDraft, admission: Admission) -> None:
        """The admission stored the lease: renewals carry it from now on."""
        lease = draft.lease
        if lease is None:
            return
        lease.epoch = admission.epoch
        self._leases[lease.request_id] = lease
        if admission.new_epoch:
            # Redis may have restarted empty: name every hash and this replica again now,
            # not at the next renewal (a crash before it would leave these leases unfound).
            try:
                await self._name_hashes(list(self._hashes))
            except RedisError:
                # The caller fails the request (no Call will settle it), but Redis booked it:
                # give the reservation, slot and lease back, now or from the renewal loop.
                await self._abandon(lease, admission)
                raise

    async def _abandon(self, lease: Lease, admission: Admission) -> None:
        """Settle at zero an admission whose request will not run, with its usage row."""

        async def attempt() -> None:
            pipe = self._redis.pipeline(transaction=False)
            pipe.execute_command(*self._limiter.settle_command(admission, 0, 0))
            self._recorder.record_in(pipe, lease.usage_event())
            settled, *_ = await pipe.execute(raise_on_error=False)
            if isinstance(settled, Exception):
                await self._limiter.settle(admission, 0, 0)  # the script was not loaded

        try:
            await attempt()
        except RedisError:
            self.settle_later(lease.request_id, attempt, prompt_tokens=0, completion_tokens=0)
            return
        self.forget(lease.request_id)

    async def _name_hashes(self, hash_keys: list[str]) -> None:
        pipe = self._redis.pipeline(transaction=False)
        if hash_keys:
            pipe.sadd(self._hashes_key, *hash_keys)
        pipe.eval(ALIVE_LUA, 1, self._replicas, self.instance_id, self.lease_s)
        await pipe.execute()

    def progress(
        self,
        request_id: str,
        *,
        prompt_tokens: int,
        delivered_tokens: int,
        first_token: bool,
        deployment: str | None,
        reply_to: str = "",
    ) -> None:
        lease = self._leases.get(request_id)
        if lease is None:
            return
        if prompt_tokens:
            lease.prompt_tokens = prompt_tokens
        lease.delivered_tokens = delivered_tokens
        lease.deployment = deployment or lease.deployment
        lease.reply_to = reply_to or lease.reply_to
        if first_token and not lease.first_token:
            # From now on the request is billed if this replica dies: store that at once.
            lease.first_token = True
            self._first_tokens.append(lease)
            if self._storing is None:
                self._storing = asyncio.get_running_loop().create_task(self._store_first_tokens())

    async def first_tokens_stored(self) -> None:
        """Wait for the write of the leases whose first token just went out, before that
        token reaches the client: a replica killed after its client saw output but before
        the write landed would leave a lease that bills nothing. Every stream starting in the
        meantime waits for the same batched write."""
        storing = self._storing
        if storing is not None:
            await asyncio.shield(storing)

    async def _store_first_tokens(self) -> None:
        """Stores the leases whose first token went out: those that came while a write was in
        flight go together in the next, on the request path's own connection (joined with
        other requests' commands), so many streams starting at once cost neither a task nor
        a redis-py call each."""
        try:
            while self._first_tokens:
                leases, self._first_tokens = self._first_tokens, []
                by_hash: dict[str, list[Lease]] = {}
                for lease in leases:
                    if lease.request_id in self._leases:
                        by_hash.setdefault(lease.settle_keys[-1], []).append(lease)
                now = time.time()
                commands = []
                for group in by_hash.values():
                    keys, args = renew_call(group, now, self._limiter.slot_ttl_s)
                    commands.append(("EVAL", RENEW_LUA, len(keys), *keys, *args))
                if commands:
                    # A failed write is retried by the next renewal, which carries every lease.
                    with contextlib.suppress(RedisError):
                        await self._limiter.batch.execute(*commands)
        finally:
            self._storing = None

    def forget(self, request_id: str) -> None:
        """The request was settled here (which released its stored lease)."""
        self._leases.pop(request_id, None)

    def settle_later(
        self,
        request_id: str,
        attempt: Callable[[], Awaitable[None]],
        *,
        prompt_tokens: int,
        completion_tokens: int,
    ) -> None:
        """The request ended but its settle could not reach Redis: keep renewing its lease,
        now with the final counts (so a peer bills them if this replica dies), and run
        ``attempt`` (idempotent, as any settle) from the renewal loop until it lands."""
        lease = self._leases.get(request_id)
        if lease is not None:
            lease.prompt_tokens = prompt_tokens
            lease.delivered_tokens = completion_tokens
            lease.first_token = lease.first_token or prompt_tokens + completion_tokens > 0
        self._pending[request_id] = _PendingSettle(attempt, time.monotonic())
        logger.warning("settle of %s deferred: Redis unreachable; retrying", request_id)

    @property
    def pending_settles(self) -> int:
        return len(self._pending)

    async def settle_pending(self) -> None:
        """Retry the settles Redis refused; stop at the first failure (Redis is away)."""
        for request_id, pending in list(self._pending.items()):
            try:
                await pending.attempt()
            except RedisError as exc:
                waited = time.monotonic() - pending.since
                if waited < SETTLE_RETRY_LIMIT_S:
                    return
                del self._pending[request_id]
                self._leases.pop(request_id, None)
                logger.error(
                    "gave up settling %s after %.0f s (%s); a peer settles its stored lease "
                    "once this replica stops",
                    request_id,
                    waited,
                    exc,
                )
                continue
            del self._pending[request_id]
            self._leases.pop(request_id, None)
            logger.info("settled %s after Redis came back", request_id)

    async def renew(self) -> None:
        """Rewrite the stored leases with the current ones and extend this replica's life.

        Also puts back leases a Redis restart lost; never one settled meanwhile (RENEW_LUA)."""
        now = time.time()
        by_hash: dict[str, list[Lease]] = {}
        for lease in self._leases.values():
            lease.renewed_at = now
            by_hash.setdefault(lease.settle_keys[-1], []).append(lease)
        used = time.monotonic()
        for hash_key in by_hash:
            self._hashes[hash_key] = used
        idle = [name for name, at in self._hashes.items() if used - at > self._hash_idle_s]
        for name in idle:
            del self._hashes[name]
        pipe: Pipeline = self._redis.pipeline(transaction=False)
        for leases in by_hash.values():
            keys, args = renew_call(leases, now, self._limiter.slot_ttl_s)
            pipe.eval(RENEW_LUA, len(keys), *keys, *args)
        if by_hash:
            # Only the hashes holding leases (named again after a Redis restart lost the set).
            pipe.sadd(self._hashes_key, *by_hash)
        if idle:
            pipe.srem(self._hashes_key, *idle)
        pipe.eval(ALIVE_LUA, 1, self._replicas, self.instance_id, self.lease_s)
        try:
            if idle:
                async with self._naming:
                    await pipe.execute()
            else:
                await pipe.execute()
        except RedisError:
            self._healthy_since = None
            raise
        if self._healthy_since is None:
            self._healthy_since = time.monotonic()

    async def reap(self) -> int:
        """Settle the leases of every replica whose renewal lapsed; how many it settled.

        Only once this replica has itself reached Redis and renewed for ``lease_s`` without a
        failure: after an outage every peer's entry is past its expiry when Redis comes back,
        and the live ones need up to ``lease_s`` to renew theirs. Reaping before would settle
        their running requests as dead and cancel their streams."""
        if self._healthy_since is None or time.monotonic() - self._healthy_since < self.lease_s:
            return 0
        try:
            return await self._reaper.reap()
        except RedisError:
            self._healthy_since = None
            raise

    # ---- the background task ---------------------------------------------------------------

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"leases-{self.instance_id}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._pending:
            # A last try on the way out; what still fails stays stored for a peer's reaper.
            with contextlib.suppress(RedisError):
                await self.settle_pending()

    async def _run(self) -> None:
        renew_every = self.lease_s / 3
        next_renewal = 0.0
        while True:
            try:
                if time.monotonic() >= next_renewal:
                    await self.renew()
                    next_renewal = time.monotonic() + renew_every
                if self._pending:
                    await self.settle_pending()
                await self.reap()
            except RedisError as exc:
                logger.warning("leases: redis unavailable (%s); retrying", exc)
            except Exception:
                logger.exception("leases: renewal or reaping failed")
            await asyncio.sleep(min(_REAP_EVERY_S, renew_every))

"""This replica's side of the leases (``gateway.leases``): a draft for each admission, the
renewals, and the background task that renews and reaps."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import RedisError

from gateway.lease_reaper import LeaseReaper
from gateway.leases import (
    RENEW_LUA,
    Lease,
    LeaseDraft,
    lease_hash_key,
    lease_hashes_key,
    renew_call,
    replicas_key,
)
from gateway.limits import Admission, KeyLimits, RateLimiter
from gateway.settings import Settings
from gateway.usage import UsageRecorder

logger = logging.getLogger(__name__)

_REAP_EVERY_S = 1.0


class LeaseBook:
    """This replica's leases: stored by admission, renewed in bulk, released by settlement;
    and the background task that renews them and reaps replicas that died."""

    def __init__(
        self,
        redis: Redis,
        settings: Settings,
        limiter: RateLimiter,
        recorder: UsageRecorder,
    ) -> None:
        self._redis = redis
        self.instance_id = settings.instance_id
        self.lease_s = settings.lease_s
        self._hashes_key = lease_hashes_key(self.instance_id)
        self._replicas = replicas_key(settings.usage_stream)
        self._leases: dict[str, Lease] = {}
        self._hashes: set[str] = set()
        """Lease hashes this replica named in its set (and so may store leases in)."""
        self._task: asyncio.Task[None] | None = None
        self._writes: set[asyncio.Task[None]] = set()
        self._reaper = LeaseReaper(redis, self.instance_id, self._replicas, limiter, recorder)

    @property
    def reaped(self) -> int:
        return self._reaper.reaped

    # ---- this replica's leases -------------------------------------------------------------

    async def draft(
        self, key: KeyLimits, *, model: str, prompt_estimate: int, started_at: float
    ) -> LeaseDraft:
        """The lease the admission of a request of ``key`` will store. The first time this
        replica uses the key's hash, it names it in its set first, so a reaper finds it."""
        hash_key = lease_hash_key(key, self.instance_id)
        if hash_key not in self._hashes:
            await self._name_hashes([hash_key])
            self._hashes.add(hash_key)
        return LeaseDraft(hash_key, model, prompt_estimate, started_at)

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
            await self._name_hashes(list(self._hashes))

    async def _name_hashes(self, hash_keys: list[str]) -> None:
        pipe = self._redis.pipeline(transaction=False)
        if hash_keys:
            pipe.sadd(self._hashes_key, *hash_keys)
        pipe.zadd(self._replicas, {self.instance_id: time.time() + self.lease_s})
        await pipe.execute()

    def progress(
        self,
        request_id: str,
        *,
        prompt_tokens: int,
        delivered_tokens: int,
        first_token: bool,
        deployment: str | None,
    ) -> None:
        lease = self._leases.get(request_id)
        if lease is None:
            return
        if prompt_tokens:
            lease.prompt_tokens = prompt_tokens
        lease.delivered_tokens = delivered_tokens
        lease.deployment = deployment or lease.deployment
        if first_token and not lease.first_token:
            # From now on the request is billed if this replica dies: store that at once.
            lease.first_token = True
            task = asyncio.get_running_loop().create_task(self._write(lease))
            self._writes.add(task)
            task.add_done_callback(self._writes.discard)

    async def _write(self, lease: Lease) -> None:
        with contextlib.suppress(RedisError):
            if lease.request_id in self._leases:
                keys, args = renew_call([lease])
                await self._redis.eval(RENEW_LUA, len(keys), *keys, *args)

    def forget(self, request_id: str) -> None:
        """The request is being settled here (which releases its stored lease)."""
        self._leases.pop(request_id, None)

    async def renew(self) -> None:
        """Rewrite the stored leases with the current ones and extend this replica's life.

        Also puts back leases a Redis restart lost; never one settled meanwhile (RENEW_LUA)."""
        now = time.time()
        by_hash: dict[str, list[Lease]] = {}
        for lease in self._leases.values():
            lease.renewed_at = now
            by_hash.setdefault(lease.settle_keys[-1], []).append(lease)
        pipe: Pipeline = self._redis.pipeline(transaction=False)
        for leases in by_hash.values():
            keys, args = renew_call(leases)
            pipe.eval(RENEW_LUA, len(keys), *keys, *args)
        if self._hashes:
            pipe.sadd(self._hashes_key, *self._hashes)
        pipe.zadd(self._replicas, {self.instance_id: now + self.lease_s})
        await pipe.execute()

    async def reap(self) -> int:
        """Settle the leases of every replica whose renewal lapsed; how many it settled."""
        return await self._reaper.reap()

    # ---- the background task ---------------------------------------------------------------

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"leases-{self.instance_id}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        renew_every = self.lease_s / 3
        next_renewal = 0.0
        while True:
            try:
                if time.monotonic() >= next_renewal:
                    await self.renew()
                    next_renewal = time.monotonic() + renew_every
                await self.reap()
            except RedisError as exc:
                logger.warning("leases: redis unavailable (%s); retrying", exc)
            except Exception:
                logger.exception("leases: renewal or reaping failed")
            await asyncio.sleep(min(_REAP_EVERY_S, renew_every))

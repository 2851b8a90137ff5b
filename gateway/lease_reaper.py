"""Settling the requests of gateway replicas that died (``gateway.leases``).

A reaper on every replica looks for replicas whose entry in ``<usage stream>:replicas``
expired, reads their leases from the hashes their set names, and settles each as the dead
replica would have; generations still running for the dead replica are cancelled. The settle
script releases the lease: of several reapers (or a replica that was only paused) exactly one
releases it, and only that one writes the usage event.

What a reaped request is billed: its prompt once (the engine's count when it reported one),
and the completion tokens its lease says were delivered to the client, as of the replica's
last lease write — not what the engine produced. The promise is that every token served is
counted exactly once, and served means delivered to the client. The engine goes on generating
after the replica died, until the reaper's Cancel lands (``lease_s`` and more later): the
client never saw those tokens, so they are not billed, though the engine spent them (an
operator's cost of the crash, visible in the engine's own metrics). The tokens relayed between
the replica's last lease write and its death (at most ``lease_s / 3`` of streaming) are the
one thing lost, in the client's favour: the replica died without telling anyone, and billing
the engine's count instead would charge at least twice as many that never reached anyone.
"""

from __future__ import annotations

import logging

import msgspec
from redis.asyncio import Redis

from engine import protocol
from gateway.leases import EXPIRED_LUA, Lease, decoder, lease_hashes_key
from gateway.limits import RateLimiter
from gateway.usage import UsageRecorder

logger = logging.getLogger(__name__)


class LeaseReaper:
    def __init__(
        self,
        redis: Redis,
        instance_id: str,
        replicas: str,
        limiter: RateLimiter,
        recorder: UsageRecorder,
    ) -> None:
        self._redis = redis
        self._instance_id = instance_id
        self._replicas = replicas
        self._limiter = limiter
        self._recorder = recorder
        self.reaped = 0

    async def reap(self) -> int:
        """Settle the leases of every replica whose renewal lapsed; how many it settled."""
        dead = await self._redis.eval(EXPIRED_LUA, 1, self._replicas)
        settled = 0
        for raw in dead:
            instance = raw.decode() if isinstance(raw, bytes) else str(raw)
            if instance == self._instance_id:
                continue
            settled += await self._reap_replica(instance)
        return settled

    async def _reap_replica(self, instance: str) -> int:
        hashes_key = lease_hashes_key(instance)
        names = list(await self._redis.smembers(hashes_key))
        pipe = self._redis.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(name)
        settled = 0
        for name, leases in zip(names, await pipe.execute(), strict=True):
            for field, raw in leases.items():
                try:
                    lease = decoder.decode(raw)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    logger.error(
                        "dropping malformed lease %r of replica %s: %s", field, instance, exc
                    )
                    await self._redis.hdel(name, field)
                    continue
                settled += await self._settle(lease)
        # Forget the replica once nothing is left; a lease written meanwhile (it is alive
        # after all) brings it back with its next renewal.
        pipe = self._redis.pipeline(transaction=False)
        for name in names:
            pipe.hlen(name)
        if not any(await pipe.execute()):
            pipe = self._redis.pipeline(transaction=False)
            pipe.delete(hashes_key)
            pipe.zrem(self._replicas, instance)
            await pipe.execute()
        if settled:
            logger.warning("settled %d requests of gateway replica %s, gone", settled, instance)
        return settled

    async def _engine_prompt(self, lease: Lease) -> None:
        """Take the prompt count the engine reported for the lease's request (exact, where the
        lease may hold the admission's estimate), and stop generations nobody will read. The
        completion count stays the lease's: what was delivered (see the module's docstring)."""
        ids = [protocol.attempt_id(lease.request_id, n) for n in range(protocol.MAX_RESUMES + 1)]
        pipe = self._redis.pipeline(transaction=False)
        for engine_id in ids:
            pipe.hgetall(protocol.produced_key(engine_id))
        records = await pipe.execute()
        cancels = self._redis.pipeline(transaction=False)
        for engine_id, record in zip(ids, records, strict=True):
            if not record:
                continue
            if engine_id == lease.request_id and int(record.get(b"p", 0)):
                lease.prompt_tokens = int(record[b"p"])
            if not int(record.get(b"d", 0)):
                model = record.get(b"m", b"").decode()
                cancels.publish(
                    protocol.cancel_channel(model), protocol.encode(protocol.Cancel(engine_id))
                )
        if len(cancels):
            await cancels.execute()

    async def _settle(self, lease: Lease) -> int:
        """Settle one lease; 1 when this reaper released it (and so wrote its usage)."""
        await self._engine_prompt(lease)
        event = lease.usage_event()
        billed = event.prompt_tokens + event.completion_tokens
        if not await self._limiter.settle(
            lease.admission(), billed, event.cost_micros, reaping=True
        ):
            return 0  # another reaper, or the replica itself, settled it
        await self._recorder.record(event)
        self.reaped += 1
        return 1

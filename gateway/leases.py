"""Crash-safe settlement: every admitted request leaves a lease that outlives its replica.

A request is settled (reservation corrected, concurrency slot freed, usage event written) by
the replica that serves it when it ends. A replica that dies mid-request (OOM, node loss)
never gets there. So admission also writes a *lease*: what is known of the request so far
(key, model, reservation, prompt tokens, tokens relayed to the client), in the replica's hash
``sg:gw:{<instance>}:leases``. The replica rewrites that hash with its current leases every
``lease_s / 3`` and renews its own entry in the sorted set ``<usage stream>:replicas``
(score: the time it expires). A reaper on every replica looks for replicas whose entry expired, takes
each of their leases (HDEL: exactly one reaper gets it) and settles it as the dead replica
would have: the prompt once, plus the tokens the engine reports it produced for the request
(or, for upstreams that are not our engine, those relayed up to the replica's last renewal);
generations still running for the dead replica are cancelled.

Settling twice is harmless: the reservation's ``held`` marker (see ``gateway.limits``) lets
only the first settle correct the counters, and usage rows are idempotent on request id.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import msgspec
from redis.asyncio import Redis
from redis.asyncio.client import Pipeline
from redis.exceptions import RedisError

from engine import protocol
from gateway.limits import Admission, RateLimiter
from gateway.pricing import Price
from gateway.settings import Settings
from gateway.usage import UsageEvent, UsageRecorder

logger = logging.getLogger(__name__)

_REAP_EVERY_S = 1.0


def replicas_key(usage_stream: str) -> str:
    """The replicas of one deployment: those that write usage to the same stream (replicas of
    another deployment on the same Redis bill into another database and must not reap ours)."""
    return f"{usage_stream}:replicas"


def leases_key(instance_id: str) -> str:
    return f"sg:gw:{{{instance_id}}}:leases"


class Lease(msgspec.Struct, kw_only=True, omit_defaults=True):
    request_id: str
    key_id: str
    model: str
    reserved_tokens: int
    settle_keys: list[str]
    reserved_micros: int = 0
    price: Price | None = None
    team_id: str | None = None
    epoch: str = ""
    started_at: float
    prompt_tokens: int = 0
    """The real prompt count once the provider reported it, else the admission estimate."""
    delivered_tokens: int = 0
    first_token: bool = False
    """Whether anything was generated: a request that produced nothing is billed nothing."""
    deployment: str | None = None
    renewed_at: float = 0.0

    def admission(self) -> Admission:
        return Admission(
            self.key_id,
            self.request_id,
            self.reserved_tokens,
            self.settle_keys,
            {},
            price=self.price,
            reserved_micros=self.reserved_micros,
            team_id=self.team_id,
            epoch=self.epoch,
        )

    def usage_event(self) -> UsageEvent:
        prompt = self.prompt_tokens if self.first_token else 0
        completion = self.delivered_tokens if self.first_token else 0
        finished = self.renewed_at or self.started_at
        return UsageEvent(
            request_id=self.request_id,
            key_id=self.key_id,
            model=self.model,
            deployment=self.deployment,
            prompt_tokens=prompt,
            completion_tokens=completion,
            cost_micros=self.admission().cost_micros(prompt, completion),
            team_id=self.team_id,
            status="error",
            latency_ms=max(0.0, finished - self.started_at) * 1000,
            started_at=self.started_at,
            finished_at=finished,
        )


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Lease)


class LeaseBook:
    """This replica's leases: written at admission, renewed in bulk, dropped at settlement;
    and the reaper that settles the leases of replicas that died."""

    def __init__(
        self,
        redis: Redis,
        settings: Settings,
        limiter: RateLimiter,
        recorder: UsageRecorder,
    ) -> None:
        self._redis = redis
        self._limiter = limiter
        self._recorder = recorder
        self.instance_id = settings.instance_id
        self.lease_s = settings.lease_s
        self._key = leases_key(self.instance_id)
        self._replicas = replicas_key(settings.usage_stream)
        self._leases: dict[str, Lease] = {}
        self._task: asyncio.Task[None] | None = None
        self._writes: set[asyncio.Task[None]] = set()
        self.reaped = 0

    # ---- this replica's leases -------------------------------------------------------------

    async def open(self, lease: Lease) -> None:
        """Record a new admission now (a crash right after admission is still settled)."""
        self._leases[lease.request_id] = lease
        lease.renewed_at = time.time()
        try:
            pipe = self._redis.pipeline(transaction=False)
            pipe.hset(self._key, lease.request_id, _encoder.encode(lease))
            pipe.zadd(self._replicas, {self.instance_id: time.time() + self.lease_s})
            await pipe.execute()
        except RedisError as exc:
            logger.warning(
                "lease of %s not written yet (%s); the next renewal retries",
                lease.request_id,
                exc,
            )

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
                await self._redis.hset(self._key, lease.request_id, _encoder.encode(lease))

    def forget(self, request_id: str) -> None:
        """The request is being settled here: renewals no longer carry its lease."""
        self._leases.pop(request_id, None)

    def drop_in(self, pipeline: Pipeline, request_id: str) -> None:
        """Delete the stored lease on the pipeline that settles the request."""
        pipeline.hdel(self._key, request_id)

    async def renew(self) -> None:
        """Replace the stored leases with the current ones and extend this replica's life.

        A full rewrite (DEL + HSET in one transaction) also restores leases a Redis restart
        lost, and drops any a racing settlement deleted just before a renewal wrote it back."""
        now = time.time()
        for lease in self._leases.values():
            lease.renewed_at = now
        mapping = {rid: _encoder.encode(lease) for rid, lease in self._leases.items()}
        pipe = self._redis.pipeline(transaction=True)
        pipe.delete(self._key)
        if mapping:
            pipe.hset(self._key, mapping=mapping)
        await pipe.execute()
        await self._redis.zadd(self._replicas, {self.instance_id: now + self.lease_s})

    # ---- the reaper ------------------------------------------------------------------------

    async def reap(self) -> int:
        """Settle the leases of every replica whose renewal lapsed; how many it settled."""
        dead = await self._redis.zrangebyscore(self._replicas, "-inf", time.time())
        settled = 0
        for raw in dead:
            instance = raw.decode() if isinstance(raw, bytes) else str(raw)
            if instance == self.instance_id:
                continue
            settled += await self._reap_replica(instance)
        return settled

    async def _reap_replica(self, instance: str) -> int:
        key = leases_key(instance)
        leases = await self._redis.hgetall(key)
        settled = 0
        for field, raw in leases.items():
            if not await self._redis.hdel(key, field):
                continue  # another reaper took it
            try:
                lease = _decoder.decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.error("dropping malformed lease %r of replica %s: %s", field, instance, exc)
                continue
            await self._settle(lease)
            settled += 1
        # Forget the replica once nothing is left; a lease written meanwhile (it is alive
        # after all) brings it back with its next renewal.
        if not await self._redis.hlen(key):
            await self._redis.zrem(self._replicas, instance)
        if settled:
            logger.warning("settled %d requests of gateway replica %s, gone", settled, instance)
        return settled

    async def _engine_produced(self, lease: Lease) -> None:
        """Raise the lease's counts to what the engine reports it produced (the worker goes
        on after the replica died; tokens relayed after the last renewal are in there too),
        and stop generations nobody will read. Only a request that had begun to reach its
        client is billed: one whose client got nothing (a whole answer not sent yet) is not,
        as when a client hangs up before its first token."""
        ids = [protocol.attempt_id(lease.request_id, n) for n in range(protocol.MAX_RESUMES + 1)]
        pipe = self._redis.pipeline(transaction=False)
        for engine_id in ids:
            pipe.hgetall(protocol.produced_key(engine_id))
        records = await pipe.execute()
        cancels = self._redis.pipeline(transaction=False)
        for engine_id, record in zip(ids, records, strict=True):
            if not record:
                continue
            produced = int(record.get(b"n", 0))
            if lease.first_token:
                lease.delivered_tokens = max(lease.delivered_tokens, produced)
            if engine_id == lease.request_id and int(record.get(b"p", 0)):
                lease.prompt_tokens = int(record[b"p"])
            if not int(record.get(b"d", 0)):
                model = record.get(b"m", b"").decode()
                cancels.publish(
                    protocol.cancel_channel(model), protocol.encode(protocol.Cancel(engine_id))
                )
        if len(cancels):
            await cancels.execute()

    async def _settle(self, lease: Lease) -> None:
        await self._engine_produced(lease)
        event = lease.usage_event()
        billed = event.prompt_tokens + event.completion_tokens
        pipe = self._redis.pipeline(transaction=False)
        admission = lease.admission()
        pipe.execute_command(*self._limiter.settle_command(admission, billed, event.cost_micros))
        self._recorder.record_in(pipe, event)
        settled, _ = await pipe.execute(raise_on_error=False)
        if isinstance(settled, Exception):
            await self._limiter.settle(admission, billed, event.cost_micros)
        self.reaped += 1

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


def lease_for(
    admission: Admission, *, model: str, prompt_estimate: int, started_at: float
) -> Lease:
    return Lease(
        request_id=admission.request_id,
        key_id=admission.key_id,
        model=model,
        reserved_tokens=admission.reserved_tokens,
        settle_keys=admission.settle_keys,
        reserved_micros=admission.reserved_micros,
        price=admission.price,
        team_id=admission.team_id,
        epoch=admission.epoch,
        started_at=started_at,
        prompt_tokens=prompt_estimate,
    )

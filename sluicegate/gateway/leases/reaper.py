"""Settling the requests of gateway replicas that died (``sluicegate.gateway.leases.lease``).

A reaper on every replica looks for replicas whose entry in ``<usage stream>:replicas``
expired, reads their leases from the hashes their set names, and settles each as the dead
replica would have; generations still running for the dead replica are cancelled. The settle
script releases the lease: of several reapers (or a replica that was only paused) exactly one
releases it, and only that one writes the usage event.

What a reaped request is billed: its prompt once (the engine's count when it reported one),
and the completion tokens the dead replica had *read* for its client — not what the engine
produced, and not only what its lease last said. The promise is that every token served is
counted exactly once, and served means delivered to the client.

- The lease's delivered count is as of the replica's last lease write (every ``lease_s / 3``):
  the tokens relayed after it would go unbilled.
- The engine goes on generating after the replica died, until the reaper's Cancel lands
  (``lease_s`` and more later): nobody received those tokens, so they are not billed, though
  the engine spent them (an operator's cost of the crash, in the engine's own metrics).
- What the replica had read: its reply reader (``sluicegate.gateway.providers.engine.replies``) reads its
  reply stream as a consumer group with NOACK, so Redis keeps the group's last-delivered id,
  updated by every read at no extra round trip. The reaper takes that id (XINFO GROUPS on the
  stream the lease names, ``Lease.reply_to``), finds each leased request's latest delta at or
  before it (XREVRANGE back from there; a ``Batch`` entry holds deltas of several requests, a
  resumed attempt's deltas ``redis_names.attempt_id`` go to the same stream) and takes its
  ``produced``: the request's output tokens up to that delta, resumed ones included. Billed:
  the larger of that and the lease's count, never above the request's ``max_completion``.
  Every token the client received was read first, so this is never less than what it
  received; it exceeds it by at most what the replica read but had not yet relayed (one read
  batch, and a token whose text the detokenizer held back).

When the deltas are gone (trimmed by the stream's MAXLEN, the stream expired, or it was
recreated, which restarts the group), the lease's count is billed and the fallback logged.
Only single-key commands on one stream: they work on a Redis Cluster.
"""

from __future__ import annotations

import logging

import msgspec
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from sluicegate.engine import protocol, redis_names
from sluicegate.gateway.admission.limits import RateLimiter
from sluicegate.gateway.leases.lease import EXPIRED_LUA, Lease, decoder, lease_hashes_key
from sluicegate.gateway.providers.engine.replies import REPLY_GROUP
from sluicegate.gateway.usage.stream import UsageRecorder

logger = logging.getLogger(__name__)

_PAGE = 1000
"""Entries per XREVRANGE while looking back for the leased requests' latest deltas."""
_CLOCK_SLACK_S = 60.0
"""The look-back stops at entries this much older than the oldest unfound request's start
(stream ids are Redis's clock, ``started_at`` the replica's): none of its deltas is older."""


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
        leases: list[Lease] = []
        for name, stored in zip(names, await pipe.execute(), strict=True):
            for field, raw in stored.items():
                try:
                    leases.append(decoder.decode(raw))
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    logger.error(
                        "dropping malformed lease %r of replica %s: %s", field, instance, exc
                    )
                    await self._redis.hdel(name, field)
        await self._read_counts(leases)
        settled = 0
        for lease in leases:
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

    async def _read_counts(self, leases: list[Lease]) -> None:
        """Raise each streamed lease's delivered count to what its replica had read."""
        by_stream: dict[str, list[Lease]] = {}
        for lease in leases:
            if lease.first_token and lease.reply_to:
                by_stream.setdefault(lease.reply_to, []).append(lease)
        for stream, streamed in by_stream.items():
            read = await self._read_through(stream, streamed)
            for lease in streamed:
                produced = read.get(lease.request_id)
                if produced is None:
                    logger.warning(
                        "no delta of %s left in %s up to its replica's read position (trimmed, "
                        "or the stream expired): billing the lease's %d completion tokens",
                        lease.request_id,
                        stream,
                        lease.delivered_tokens,
                    )
                    continue
                if lease.max_completion:
                    produced = min(produced, lease.max_completion)
                lease.delivered_tokens = max(lease.delivered_tokens, produced)

    async def _read_through(self, stream: str, leases: list[Lease]) -> dict[str, int]:
        """Per leased request, ``produced`` of its latest delta in ``stream`` at or before the
        position the replica had read to (a request absent: none found; 0: its worker predates
        ``Delta.produced``, so the lease's count stands)."""
        position = await self._read_position(stream)
        if position is None:
            return {}
        attempts = {
            redis_names.attempt_id(lease.request_id, n): lease
            for lease in leases
            for n in range(redis_names.MAX_RESUMES + 1)
        }
        found: dict[str, int] = {}
        upper = position
        while len(found) < len(leases):
            entries = await self._redis.xrevrange(stream, max=upper, min="-", count=_PAGE)
            for _, fields in entries:
                for delta in _deltas(fields):
                    lease = attempts.get(delta.request_id)
                    if lease is not None and lease.request_id not in found:
                        found[lease.request_id] = delta.produced
            if len(entries) < _PAGE:
                break  # the stream's first entry
            oldest = entries[-1][0]
            oldest = oldest.decode() if isinstance(oldest, bytes) else str(oldest)
            unfound = [lease.started_at for lease in leases if lease.request_id not in found]
            if unfound and int(oldest.split("-")[0]) < (min(unfound) - _CLOCK_SLACK_S) * 1000:
                break  # older than any request still sought
            upper = f"({oldest}"
        return {rid: produced for rid, produced in found.items() if produced}

    async def _read_position(self, stream: str) -> str | None:
        """The reply group's last-delivered id: how far the replica had read ``stream``."""
        try:
            groups = await self._redis.xinfo_groups(stream)
        except ResponseError as exc:  # no such key: expired
            logger.warning("reply stream %s of a dead replica is gone (%s)", stream, exc)
            return None
        for group in groups:
            name = _text(group.get("name"))
            if name == REPLY_GROUP:
                return _text(group.get("last-delivered-id"))
        logger.warning("reply stream %s of a dead replica has no reader group", stream)
        return None

    async def _engine_prompt(self, lease: Lease) -> None:
        """Take the prompt count the engine reported for the lease's request (exact, where the
        lease may hold the admission's estimate), and stop generations nobody will read. The
        completion count stays the lease's: what was delivered (see the module's docstring)."""
        ids = [
            redis_names.attempt_id(lease.request_id, n) for n in range(redis_names.MAX_RESUMES + 1)
        ]
        pipe = self._redis.pipeline(transaction=False)
        for engine_id in ids:
            pipe.hgetall(redis_names.produced_key(engine_id))
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
                    redis_names.cancel_channel(model), protocol.encode(protocol.Cancel(engine_id))
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


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _deltas(fields: dict[object, object]) -> list[protocol.Delta]:
    """The deltas of one reply entry, latest first (a ``Batch`` holds several, in order)."""
    raw = fields.get(redis_names.MESSAGE_FIELD)
    if raw is None:
        raw = fields.get(redis_names.MESSAGE_FIELD.decode())
    try:
        message = protocol.decode(raw if isinstance(raw, bytes) else b"")
    except protocol.MalformedMessage:
        return []
    parts = message.messages if isinstance(message, protocol.Batch) else [message]
    return [part for part in reversed(parts) if isinstance(part, protocol.Delta)]

"""An engine model's workers as the gateway sees them, and which stream a request goes to.

Workers announce themselves in the model's registry and keep an expiring heartbeat key each;
``live_workers`` reads both (cached briefly, one read shared by concurrent callers).

The registry only ever loses the ids of dead workers, and only live workers prune it, so a
registry that is gone altogether after workers were seen means Redis lost its data (a
restart without persistence, a failover to an empty replica), not that the workers died:
they announce themselves again at their next beat. Until then the workers last seen are
trusted, for one heartbeat TTL from when the loss was found (as long as their own keys would
have vouched for them), so a request arriving meanwhile is submitted (the workers recreate
their consumer group and read it) rather than refused with a 503.
``pick_stream`` sends a request to the worker that served the same prompt prefix recently,
when that worker is live, not out of KV room and not much busier than the least busy one;
otherwise to the model's shared stream, which every worker reads. A request with a LoRA
adapter never goes to the shared stream (a worker without LoRA could read it): it goes to one
LoRA worker's own stream, the prefix's holder as above, else the least busy of those whose
heartbeat lists the adapter, else the least busy of all (it loads the adapter from its path).
"""

from __future__ import annotations

import asyncio
import logging
import time

from redis.asyncio import Redis
from redis.exceptions import RedisError

from sluicegate.engine import protocol, redis_names
from sluicegate.gateway.providers.engine.call import REDIS_TIMEOUT_S, redis_down, text

logger = logging.getLogger("sluicegate.gateway.providers.engine.provider")

_WORKERS_CACHE_S = 0.25
_AFFINITY_TTL_S = 600
AFFINITY_SLACK = 4
"""How many more queued requests the prefix-holding worker may have than the least busy one."""
KV_FULL = 0.95
"""KV usage above which a worker is not sent requests for their prefix."""


class EngineWorkers:
    def __init__(self, redis: Redis, model: str, heartbeat_ttl_s: float) -> None:
        self._redis = redis
        self.model = model
        self._ttl_s = heartbeat_ttl_s
        self._sighting: dict[str, protocol.Heartbeat] = {}
        """What the latest read of a present registry found (trusted when it vanishes)."""
        self._registry_lost_at: float | None = None
        self.seen: dict[str, protocol.Heartbeat] = {}
        """The latest read's live workers (what ``unsupported`` judges a request by)."""
        self._seen_at = -1.0
        self._refresh: asyncio.Task[dict[str, protocol.Heartbeat]] | None = None
        self.outstanding: dict[str, int] = {}
        """Requests this provider has on each worker that started answering them."""

    async def live_workers(self) -> dict[str, protocol.Heartbeat]:
        """Heartbeats of this model's live workers (cached briefly; shared by concurrent calls)."""
        if time.monotonic() - self._seen_at < _WORKERS_CACHE_S:
            return self.seen
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.create_task(self._read_workers())
        return await asyncio.shield(self._refresh)

    async def _read_workers(self) -> dict[str, protocol.Heartbeat]:
        async with asyncio.timeout(REDIS_TIMEOUT_S):
            ids = [
                text(m) for m in await self._redis.smembers(redis_names.worker_registry(self.model))
            ]
            beats = (
                await self._redis.mget([redis_names.heartbeat_key(self.model, w) for w in ids])
                if ids
                else []
            )
        workers: dict[str, protocol.Heartbeat] = {}
        for raw in beats:
            if raw is None:
                continue
            try:
                beat = protocol.decode(raw)
            except protocol.MalformedMessage:
                continue
            if isinstance(beat, protocol.Heartbeat) and not beat.draining:
                workers[beat.worker_id] = beat
        if ids:
            self._sighting, self._registry_lost_at = workers, None
        elif self._sighting:
            workers = self._trusted_sighting()
        self.seen, self._seen_at = workers, time.monotonic()
        return workers

    def _trusted_sighting(self) -> dict[str, protocol.Heartbeat]:
        """The registry is gone though workers were seen: Redis lost its data (see above)."""
        now = time.monotonic()
        if self._registry_lost_at is None:
            self._registry_lost_at = now
            logger.warning(
                "the worker registry of %s is gone (Redis lost its data?): trusting the %d "
                "workers last seen for %gs while they announce themselves again",
                self.model,
                len(self._sighting),
                self._ttl_s,
            )
        if now - self._registry_lost_at < self._ttl_s:
            return self._sighting
        self._sighting = {}
        return {}

    async def queue_ms(self) -> float:
        """How long a new request would wait for its first token: the least of the live
        workers' estimates (``Heartbeat.queue_ms``). Where requests were waiting, a heartbeat's
        estimate keeps ageing until the next one (its queue's head waits on); where none were
        (full slots, a prompt mid-prefill) it stands as sent."""
        try:
            workers = await self.live_workers()
        except (RedisError, OSError, TimeoutError):
            return 0.0
        now = time.time()
        return min(
            (
                beat.queue_ms + (max(0.0, now - beat.time) * 1000 if beat.num_waiting else 0.0)
                for beat in workers.values()
            ),
            default=0.0,
        )

    async def pick_stream(
        self,
        hashes: list[int],
        workers: dict[str, protocol.Heartbeat],
        adapter: str | None = None,
    ) -> str:
        """The stream for a request with these prefix hashes; with ``adapter``, ``workers`` are
        the LoRA workers alone and the answer is always one of theirs."""
        shared = redis_names.request_stream(self.model)
        if adapter is not None:
            return await self._lora_stream(hashes, workers, adapter)
        if not hashes:
            return shared
        worker = await self._prefix_holder(hashes, workers)
        return redis_names.worker_stream(self.model, worker) if worker is not None else shared

    async def _lora_stream(
        self, hashes: list[int], workers: dict[str, protocol.Heartbeat], adapter: str
    ) -> str:
        worker = await self._prefix_holder(hashes, workers) if hashes else None
        if worker is None:
            holding = [w for w, beat in workers.items() if adapter in beat.loras]
            worker = min(holding or workers, key=lambda w: self._load(w, workers[w]))
        return redis_names.worker_stream(self.model, worker)

    def _load(self, worker: str, beat: protocol.Heartbeat) -> int:
        return beat.num_waiting + self.outstanding.get(worker, 0)

    async def _prefix_holder(
        self, hashes: list[int], workers: dict[str, protocol.Heartbeat]
    ) -> str | None:
        """The live worker that served the deepest of these prefixes, unless it is out of KV
        room or much busier than the least busy one."""
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                owners = await self._redis.mget(
                    [redis_names.affinity_key(self.model, h) for h in hashes]
                )
        except (RedisError, OSError, TimeoutError) as exc:
            raise redis_down(exc) from exc
        load = self.load(workers)
        least = min(load.values())
        for owner in reversed(owners):
            if owner is None:
                continue
            worker = text(owner)
            beat = workers.get(worker)
            if beat is None or beat.kv_usage > KV_FULL:
                continue
            if load[worker] <= least + AFFINITY_SLACK:
                return worker
            break
        return None

    def load(self, workers: dict[str, protocol.Heartbeat]) -> dict[str, int]:
        """Requests queued on each worker, and those this provider has on it."""
        return {w: self._load(w, beat) for w, beat in workers.items()}

    def count(self, worker: str, delta: int) -> None:
        self.outstanding[worker] = self.outstanding.get(worker, 0) + delta

    async def remember_prefix(self, hashes: list[int], worker: str) -> None:
        pipe = self._redis.pipeline(transaction=False)
        for h in hashes:
            pipe.set(redis_names.affinity_key(self.model, h), worker, ex=_AFFINITY_TTL_S)
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                await pipe.execute()
        except (RedisError, OSError, TimeoutError):
            pass

"""A worker's proof of life, kept up by a thread of its own.

Other workers take over a worker's requests when its heartbeat key expires or its in-flight
stream entries grow idle. Both must therefore mean "the process is gone", not "the event loop
was busy": a long prefill step may block the loop for seconds. So a thread with its own Redis
connection refreshes the heartbeat key (the latest snapshot the loop published) and re-claims
the in-flight entries (resetting their idle time) every interval. If the loop stops publishing
snapshots for ``stale_after_s``, the thread stops vouching for it: a hung worker is not alive.

Re-claiming is conditional: an entry another worker has meanwhile taken over (this one was
presumed dead, say through a network partition) stays with that worker, and ``on_lost`` tells
this one to stop serving it, so a request is never served twice or pulled back and forth.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis

from sluicegate.engine import protocol, redis_names
from sluicegate.engine.redis_client import sync_client

logger = logging.getLogger("sluicegate.worker")

RETRY_AFTER_FAILURE_S = 0.1
"""How soon a failed beat is tried again. After a Redis outage longer than the key's TTL (a
restart, a Sentinel failover) the gateway sees no worker until the next beat lands, so the
thread does not wait a whole interval once Redis is back."""

RECLAIM_OWN = """
-- KEYS[1] a request stream; ARGV: group, this consumer, entry ids it serves.
-- Resets the idle time of the entries still pending for this consumer and returns the ids
-- of those another consumer owns now (acknowledged or unknown entries are left alone).
local taken = {}
for i = 3, #ARGV do
    local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)[1]
    if pending then
        if pending[2] == ARGV[2] then
            redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
        else
            taken[#taken + 1] = ARGV[i]
        end
    end
end
return taken
"""


class LivenessThread(threading.Thread):
    def __init__(
        self,
        redis_url: str,
        model: str,
        worker_id: str,
        in_flight_entries: Callable[[], list[tuple[str, bytes]]],
        on_lost: Callable[[str, list[bytes]], None] | None = None,
        interval_s: float = 1.0,
        ttl_s: float = 3.0,
        stale_after_s: float = 60.0,
    ) -> None:
        super().__init__(name=f"liveness-{worker_id}", daemon=True)
        self.client = sync_client(
            redis_url, socket_connect_timeout=1.0, socket_timeout=max(1.0, ttl_s / 2)
        )
        self.model = model
        self.worker_id = worker_id
        self.in_flight_entries = in_flight_entries
        self.on_lost = on_lost
        """Called (from this thread) with entries another worker took over from this one."""
        self._reclaim = self.client.register_script(RECLAIM_OWN)
        self.interval_s = interval_s
        self.ttl_ms = int(ttl_s * 1000)
        self.stale_after_s = stale_after_s
        self._payload = b""
        self._published_at = 0.0
        self._stop_event = threading.Event()

    def publish(self, heartbeat: protocol.Heartbeat) -> None:
        """Called by the event loop with a fresh snapshot."""
        self._payload = protocol.encode(heartbeat)
        self._published_at = time.monotonic()

    def stop(self, remove_key: bool = True) -> None:
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout=5)
        if remove_key:
            try:
                self.client.delete(redis_names.heartbeat_key(self.model, self.worker_id))
            except (redis.RedisError, OSError):
                pass
        self.client.close()

    def beat(self) -> None:
        """One refresh; raises on Redis errors."""
        if time.monotonic() - self._published_at > self.stale_after_s:
            logger.error("event loop silent for %.0fs: no longer heartbeating", self.stale_after_s)
            return
        pipe = self.client.pipeline(transaction=False)
        pipe.set(
            redis_names.heartbeat_key(self.model, self.worker_id), self._payload, px=self.ttl_ms
        )
        pipe.sadd(redis_names.worker_registry(self.model), self.worker_id)
        now = time.time()
        pipe.zadd(redis_names.MODEL_REGISTRY, {self.model: now})
        pipe.zremrangebyscore(
            redis_names.MODEL_REGISTRY, "-inf", now - redis_names.MODEL_STAMP_KEPT_S
        )
        pipe.execute()
        by_stream: dict[str, list[bytes]] = {}
        for stream, entry_id in self.in_flight_entries():
            by_stream.setdefault(stream, []).append(entry_id)
        for stream, ids in by_stream.items():
            # Outside the pipeline: a cluster pipeline cannot carry scripts.
            try:
                taken = self._reclaim([stream], [redis_names.REQUEST_GROUP, self.worker_id, *ids])
            except redis.ResponseError as exc:
                # A lost group (Redis restarted empty): the pull loop recreates it.
                logger.warning("re-claiming on %s failed: %s", stream, exc)
                continue
            self._report_lost(stream, taken)

    def _report_lost(self, stream: str, taken: object) -> None:
        if isinstance(taken, list) and taken and self.on_lost is not None:
            logger.warning("%d entries on %s were taken over by another worker", len(taken), stream)
            self.on_lost(stream, [t if isinstance(t, bytes) else str(t).encode() for t in taken])

    def run(self) -> None:
        failing = False
        while not self._stop_event.wait(
            min(self.interval_s, RETRY_AFTER_FAILURE_S) if failing else self.interval_s
        ):
            try:
                self.beat()
                if failing:
                    logger.info("heartbeats resumed")
                failing = False
            except (redis.RedisError, OSError) as exc:
                if not failing:
                    logger.warning("heartbeat failed (%s); retrying", exc)
                failing = True
            except Exception:
                logger.exception("heartbeat failed")

"""A worker's proof of life, kept up by a thread of its own.

Other workers take over a worker's requests when its heartbeat key expires or its in-flight
stream entries grow idle. Both must therefore mean "the process is gone", not "the event loop
was busy": a long prefill step may block the loop for seconds. So a thread with its own Redis
connection refreshes the heartbeat key (the latest snapshot the loop published) and re-claims
the in-flight entries (resetting their idle time) every interval. If the loop stops publishing
snapshots for ``stale_after_s``, the thread stops vouching for it: a hung worker is not alive.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import redis

from engine import protocol

logger = logging.getLogger("sluicegate.worker")


class LivenessThread(threading.Thread):
    def __init__(
        self,
        redis_url: str,
        model: str,
        worker_id: str,
        in_flight_entries: Callable[[], list[tuple[str, bytes]]],
        interval_s: float = 1.0,
        ttl_s: float = 3.0,
        stale_after_s: float = 60.0,
    ) -> None:
        super().__init__(name=f"liveness-{worker_id}", daemon=True)
        self.client = redis.Redis.from_url(
            redis_url, socket_connect_timeout=1.0, socket_timeout=max(1.0, ttl_s / 2)
        )
        self.model = model
        self.worker_id = worker_id
        self.in_flight_entries = in_flight_entries
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
                self.client.delete(protocol.heartbeat_key(self.model, self.worker_id))
            except (redis.RedisError, OSError):
                pass
        self.client.close()

    def beat(self) -> None:
        """One refresh; raises on Redis errors."""
        if time.monotonic() - self._published_at > self.stale_after_s:
            logger.error("event loop silent for %.0fs: no longer heartbeating", self.stale_after_s)
            return
        pipe = self.client.pipeline(transaction=False)
        pipe.set(protocol.heartbeat_key(self.model, self.worker_id), self._payload, px=self.ttl_ms)
        pipe.sadd(protocol.worker_registry(self.model), self.worker_id)
        by_stream: dict[str, list[bytes]] = {}
        for stream, entry_id in self.in_flight_entries():
            by_stream.setdefault(stream, []).append(entry_id)
        for stream, ids in by_stream.items():
            pipe.xclaim(stream, protocol.REQUEST_GROUP, self.worker_id, 0, ids, justid=True)
        # A lost group (Redis restarted empty) fails XCLAIM; the pull loop recreates it.
        pipe.execute(raise_on_error=False)

    def run(self) -> None:
        failing = False
        while not self._stop_event.wait(self.interval_s):
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

"""Heartbeats: every interval a fresh snapshot of the engine's load goes to the liveness
thread, which keeps it in Redis for the gateway's routing and the other workers."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from engine import protocol
from engine.metrics import WorkerMetrics
from engine.worker.options import WORKER_VERSION, WorkerOptions
from engine.worker.serving import Server
from engine.worker_liveness import LivenessThread

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine

logger = logging.getLogger("sluicegate.worker")


class Heartbeats:
    def __init__(
        self,
        engine: AsyncEngine,
        options: WorkerOptions,
        metrics: WorkerMetrics,
        server: Server,
        liveness: LivenessThread,
        draining: Callable[[], bool],
    ) -> None:
        self.engine = engine
        self.options = options
        self.metrics = metrics
        self.server = server
        self.liveness = liveness
        self.draining = draining

    async def run(self) -> None:
        interval = self.options.heartbeat_interval_s
        while True:
            slept_from = time.monotonic()
            await asyncio.sleep(interval)
            late = time.monotonic() - slept_from - interval
            if late > interval:
                logger.warning("the event loop was blocked for %.1fs", late)
            try:
                self.publish()
            except Exception:
                logger.exception("heartbeat snapshot failed")

    def publish(self) -> None:
        """Hand a fresh snapshot to the liveness thread, which keeps it in Redis."""
        self.liveness.publish(self.snapshot())

    def snapshot(self) -> protocol.Heartbeat:
        stats = self.engine.stats()
        self.metrics.observe_engine_stats(stats)
        total = int(stats.get("kv_blocks_total", 0) or 0)
        used = int(stats.get("kv_blocks_used", 0) or 0)
        now = time.monotonic()
        per_second = self.server.tokens_per_second
        recent = int(now) - 5
        for second in [s for s in per_second if s < recent]:
            del per_second[second]
        tokens = sum(per_second.values())
        return protocol.Heartbeat(
            worker_id=self.options.worker_id,
            model=self.options.model_name,
            served_model_name=self.options.model_name,
            version=WORKER_VERSION,
            time=time.time(),
            num_running=int(stats.get("num_running", 0) or 0),
            num_waiting=int(stats.get("num_waiting", 0) or 0),
            kv_blocks_total=total,
            kv_blocks_used=used,
            kv_usage=used / total if total else 0.0,
            tokens_per_s=tokens / 5.0,
            max_model_len=int(stats.get("max_model_len", 0) or 0),
            block_size=int(stats.get("kv_block_size", 16) or 16),
            draining=self.draining(),
            queue_ms=_queue_ms(stats.get("oldest_waiting_arrival")),
            thinking=bool(stats.get("thinking")),
        )


def _queue_ms(oldest_arrival: float | None) -> float:
    """Milliseconds the head of the engine's queue has waited (0 with no queue)."""
    if oldest_arrival is None:
        return 0.0
    return max(0.0, (time.monotonic() - oldest_arrival) * 1000)

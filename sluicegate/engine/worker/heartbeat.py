"""Heartbeats: every interval a fresh snapshot of the engine's load goes to the liveness
thread, which keeps it in Redis for the gateway's routing and the other workers."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from sluicegate.engine import protocol
from sluicegate.engine.kv_events.publisher import KvEventPublisher
from sluicegate.engine.worker.liveness import LivenessThread
from sluicegate.engine.worker.metrics import WorkerMetrics
from sluicegate.engine.worker.options import WORKER_VERSION, WorkerOptions
from sluicegate.engine.worker.queue_estimate import FINISH_WINDOW_S, QueueState, queue_ms
from sluicegate.engine.worker.serving import Server

if TYPE_CHECKING:
    from sluicegate.engine.serving.async_engine import AsyncEngine

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
        self.kv_events: KvEventPublisher | None = None

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
        finishes = _recent(self.server.finished_per_second, now)
        seat_s = _recent(self.server.seat_ms, now) / 1000 / finishes if finishes else 0.0
        load = queue_state(stats, finishes / FINISH_WINDOW_S, now, seat_s)
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
            tokens_per_s=_recent(self.server.tokens_per_second, now) / FINISH_WINDOW_S,
            max_model_len=int(stats.get("max_model_len", 0) or 0),
            block_size=int(stats.get("kv_block_size", 16) or 16),
            draining=self.draining(),
            queue_ms=queue_ms(load),
            thinking=bool(stats.get("thinking")),
            spec_acceptance_rate=float(stats.get("spec_acceptance_rate", 0.0) or 0.0),
            tensor_parallel_size=int(stats.get("tensor_parallel_size", 1) or 1),
            dtype=str(stats.get("dtype", "")),
            weight_dtype=str(stats.get("weight_dtype", "")),
            kv_cache_dtype=str(stats.get("kv_cache_dtype", "")),
            max_loras=int(stats.get("max_loras", 0) or 0),
            max_lora_rank=int(stats.get("max_lora_rank", 0) or 0),
            loras=list(stats.get("loras") or []),
            kv_events=self.kv_events is not None and self.kv_events.started,
            tokenizer_digest=self.kv_events.tokenizer_digest if self.kv_events is not None else "",
        )


def _recent(per_second: Counter[int], now: float) -> int:
    """The count over the last ``FINISH_WINDOW_S`` seconds; older seconds are dropped."""
    recent = int(now) - int(FINISH_WINDOW_S)
    for second in [s for s in per_second if s < recent]:
        del per_second[second]
    return sum(per_second.values())


def queue_state(
    stats: Mapping[str, Any], finishes_per_s: float, now: float, seat_time_s: float = 0.0
) -> QueueState:
    """The engine's stats (``AsyncEngine.stats()``) and the recent finishes (rate, mean time
    in a running slot) as the queue estimate's inputs; ``now`` is ``time.monotonic()``.
    Requests not in the scheduler yet queue ahead of a new one too (their prompts are not
    counted: they are not tokenized or not handed over yet)."""

    def number(key: str) -> int:
        return int(stats.get(key, 0) or 0)

    oldest = stats.get("oldest_waiting_arrival")
    return QueueState(
        num_running=number("num_running"),
        num_waiting=number("num_waiting") + number("num_pending"),
        max_num_seqs=number("max_num_seqs"),
        kv_blocks_total=number("kv_blocks_total"),
        kv_blocks_used=number("kv_blocks_used"),
        waiting_blocks=number("waiting_blocks"),
        prefill_tokens=number("waiting_tokens") + number("prefill_tokens_running"),
        token_budget=number("max_num_batched_tokens"),
        step_time_s=float(stats.get("step_time_s", 0.0) or 0.0),
        finishes_per_s=finishes_per_s,
        seat_time_s=seat_time_s,
        head_age_s=max(0.0, now - oldest) if oldest is not None else 0.0,
    )

"""The scheduler's counters, as the engine's stats and the worker's heartbeat read them."""

from __future__ import annotations

from typing import Any, Protocol

from sluicegate.engine.core.block_manager import BlockManager
from sluicegate.engine.core.config import SchedulerConfig
from sluicegate.engine.core.sequence import Sequence
from sluicegate.engine.core.waiting_queue import WaitingQueue


class SchedulerState(Protocol):
    """What the counters read of ``sluicegate.engine.core.scheduler.Scheduler``."""

    config: SchedulerConfig
    block_manager: BlockManager
    running: list[Sequence]
    waiting: WaitingQueue
    peak_kv_utilization: float
    num_preemptions: int

    @property
    def kv_tokens_stored(self) -> int: ...

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...


def scheduler_stats(scheduler: SchedulerState) -> dict[str, Any]:
    """Engine-level counters; prefix-cache queries and hits are counted in tokens."""
    manager = scheduler.block_manager
    # Prompts mid-prefill (one at most, unless a more urgent request was admitted
    # in front of a less urgent one's prefill).
    prefill_left = sum(
        left for s in scheduler.running if (left := s.num_tokens - s.num_computed_tokens) > 1
    )
    return {
        "kv_blocks_total": manager.num_blocks,
        "kv_blocks_used": manager.num_used_blocks,
        "kv_tokens_stored": scheduler.kv_tokens_stored,
        "peak_kv_utilization": scheduler.peak_kv_utilization,
        "num_running": scheduler.num_running,
        "num_waiting": scheduler.num_waiting,
        # What a new request's wait is estimated from (sluicegate.engine.worker.queue_estimate): the
        # queue head's arrival (monotonic), what the queue and a prompt mid-prefill (only
        # the youngest running sequence can be) must compute, and one step's limits.
        "oldest_waiting_arrival": scheduler.waiting[0].arrival_time if scheduler.waiting else None,
        "waiting_tokens": scheduler.waiting.num_tokens,
        "waiting_blocks": scheduler.waiting.num_blocks,
        "prefill_tokens_running": prefill_left if prefill_left > 1 else 0,
        "max_num_seqs": scheduler.config.max_num_seqs,
        "max_model_len": scheduler.config.max_model_len,
        "max_num_batched_tokens": scheduler.config.max_num_batched_tokens,
        "num_preemptions": scheduler.num_preemptions,
        "prefix_cache_queries": manager.prefix_cache_queries,
        "prefix_cache_hits": manager.prefix_cache_hits,
    }

"""Scheduler configuration: the knobs that bound one engine's batch and KV cache."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True)
class SchedulerConfig:
    """Limits the scheduler enforces every step.

    ``num_kv_blocks`` and ``max_model_len`` come from the model runner (cache size and the
    model's context length); the rest are serving choices.
    """

    num_kv_blocks: int
    max_model_len: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    # None leaves the waiting queue unbounded; a worker uses it to stop pulling work.
    max_waiting: int | None = None
    # LoRA: at most this many distinct adapters run at once (0: no adapters at all).
    max_loras: int = 0

    def __post_init__(self) -> None:
        for name in ("num_kv_blocks", "max_model_len", "block_size", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0 or None, got {self.max_waiting}")

    @property
    def num_kv_slots(self) -> int:
        return self.num_kv_blocks * self.block_size

"""Pinned host buffers for a step's host-to-device input copy (CUDA only).

A copy from pinned memory with ``non_blocking=True`` runs when the stream reaches it, so
the host must not refill its buffer before then. With async scheduling step N+1 is prepared
while step N (its input copy included) may still be queued, so the buffers alternate, and
each is refilled only after the copy last made from it has run (an event per buffer; with
two buffers that wait is for step N-1's copy, long done by the time N+1 is prepared)."""

from __future__ import annotations

import numpy as np
import torch


class PinnedStaging:
    def __init__(self, capacity: int, count: int = 2) -> None:
        self._buffers = [
            torch.zeros(capacity, dtype=torch.int32, pin_memory=True) for _ in range(count)
        ]
        self._arrays = [buffer.numpy() for buffer in self._buffers]
        self._events: list[torch.cuda.Event | None] = [None] * count
        self._current = 0

    def acquire(self) -> np.ndarray:
        """The next buffer to fill (a numpy view), once its previous copy has run."""
        self._current = (self._current + 1) % len(self._buffers)
        event = self._events[self._current]
        if event is not None:
            event.synchronize()
        return self._arrays[self._current]

    def copy_to(self, device: torch.Tensor, size: int) -> None:
        """Queue the copy of the acquired buffer's first ``size`` items into ``device``."""
        device[:size].copy_(self._buffers[self._current][:size], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._events[self._current] = event

"""The engine's one door from device to host: every read of a step's results goes through
here, and each read counts, so a test can pin the number of host syncs per decode step (on
CUDA each read waits for the device; on CPU the count stands for the same points).

``start_read`` only queues the copy: on CUDA into pinned host memory behind an event, so
that ``result()`` later waits for exactly the work queued before it and not for a step
launched since (async scheduling reads step N while step N+1 runs)."""

from __future__ import annotations

from typing import Any

import torch

_reads = 0


class PendingRead:
    def __init__(self, tensor: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        if tensor.device.type == "cuda":
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
            tensor = host
        self._tensor = tensor

    def result(self) -> list[Any]:
        global _reads
        _reads += 1
        if self._event is not None:
            self._event.synchronize()
        return self._tensor.tolist()


def start_read(tensor: torch.Tensor) -> PendingRead:
    return PendingRead(tensor)


def to_host(tensor: torch.Tensor) -> list[Any]:
    return start_read(tensor).result()


def num_reads() -> int:
    """Device-to-host reads so far in this process."""
    return _reads

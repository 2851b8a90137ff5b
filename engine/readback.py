"""The engine's one door from device to host: every read of a step's results goes through
``to_host``, which counts, so a test can pin the number of host syncs per decode step (on
CUDA each read waits for the device; on CPU the count stands for the same points)."""

from __future__ import annotations

from typing import Any

import torch

_reads = 0


def to_host(tensor: torch.Tensor) -> list[Any]:
    global _reads
    _reads += 1
    return tensor.tolist()


def num_reads() -> int:
    """Device-to-host reads so far in this process."""
    return _reads

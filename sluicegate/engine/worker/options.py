"""A worker's settings, and the small helpers every part of the worker shares."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("sluicegate.worker")

WORKER_VERSION = "0.1.0"


@dataclass
class WorkerOptions:
    model_name: str
    redis_url: str = "redis://127.0.0.1:6379/0"
    worker_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    heartbeat_interval_s: float = 1.0
    heartbeat_ttl_s: float = 3.0
    claim_idle_s: float = 3.0
    """An entry nobody re-claimed for this long belongs to a dead worker."""
    max_pull: int = 16
    drain_timeout_s: float = 30.0
    """On SIGTERM, how long in-flight requests may run before they are handed back."""


class Backoff:
    """Exponential reconnect delay (0.05 s doubling to 2 s), logged once per outage."""

    def __init__(self) -> None:
        self.delay = 0.0

    def reset(self) -> None:
        if self.delay:
            logger.info("redis is reachable again")
        self.delay = 0.0

    async def wait(self, what: str, exc: BaseException) -> None:
        if not self.delay:
            logger.warning("%s: redis unavailable (%s); retrying with backoff", what, exc)
        self.delay = min(2.0, max(0.05, self.delay * 2))
        await asyncio.sleep(self.delay)


def text(value: Any) -> str:
    """A Redis reply's bytes as text."""
    return value.decode() if isinstance(value, bytes | bytearray) else str(value)

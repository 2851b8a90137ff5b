"""The engine worker: one ``AsyncEngine`` fed from Redis Streams, one job per module —
``intake`` (pull, claim), ``admission``, ``serving`` (deltas), ``replies`` (batched writes),
``cancels``, ``heartbeat``, ``lifecycle`` (the ``Worker``, drain) and ``cli``."""

from sluicegate.engine.worker.cli import build_parser, engine_kwargs, main, serve
from sluicegate.engine.worker.lifecycle import Worker
from sluicegate.engine.worker.options import WORKER_VERSION, WorkerOptions

__all__ = [
    "WORKER_VERSION",
    "Worker",
    "WorkerOptions",
    "build_parser",
    "engine_kwargs",
    "main",
    "serve",
]

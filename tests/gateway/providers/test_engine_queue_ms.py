"""What the gateway makes of the workers' queue estimates for spill-over: the least of them,
each aged by its heartbeat's age only where requests were waiting."""

from __future__ import annotations

import time

import pytest

from sluicegate.engine import protocol
from sluicegate.gateway.providers.engine.workers import EngineWorkers


def beat(worker: str, age_s: float, queue_ms: float, num_waiting: int) -> protocol.Heartbeat:
    return protocol.Heartbeat(
        worker, "m", "m", "test", time.time() - age_s, num_waiting=num_waiting, queue_ms=queue_ms
    )


async def queue_ms(*beats: protocol.Heartbeat) -> float:
    workers = EngineWorkers(None, "m", heartbeat_ttl_s=3.0)  # type: ignore[arg-type]

    async def live() -> dict[str, protocol.Heartbeat]:
        return {b.worker_id: b for b in beats}

    workers.live_workers = live  # type: ignore[method-assign]
    return await workers.queue_ms()


async def test_a_waiting_queue_ages_with_its_heartbeat() -> None:
    assert await queue_ms(beat("w1", 1.0, 400.0, 3)) == pytest.approx(1400.0, abs=50)


async def test_an_estimate_without_a_queue_stands_as_sent() -> None:
    # Every slot busy, nobody waiting: the wait is for a finish, which ageing would not bring.
    assert await queue_ms(beat("w1", 1.0, 400.0, 0)) == 400.0
    assert await queue_ms(beat("w1", 1.0, 0.0, 0)) == 0.0


async def test_the_least_loaded_worker_decides() -> None:
    busy, free = beat("w1", 0.5, 2000.0, 9), beat("w2", 0.5, 0.0, 0)
    assert await queue_ms(busy, free) == 0.0
    assert await queue_ms(busy, beat("w2", 0.5, 300.0, 1)) == pytest.approx(800.0, abs=50)
    assert await queue_ms() == 0.0  # no live worker: nothing to judge by

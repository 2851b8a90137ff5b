"""The queue estimate on a real worker: the engine's stats carry its inputs, finished
choices are counted, and a burst that has just arrived reads long in the heartbeat at once
(not only once its head has waited)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from sluicegate.engine import protocol
from tests.engine.worker.worker_harness import running_worker

PROMPT = [5, 17, 42, 9, 100, 33]


async def until(check: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_a_burst_reads_long_before_its_head_has_waited(llama_dir: Path) -> None:
    async with running_worker(llama_dir, max_num_seqs=1) as harness:
        worker, engine, server = harness.worker, harness.engine, harness.worker.server
        sampling = protocol.Sampling(max_tokens=64, temperature=0, ignore_eos=True)
        warm = protocol.Request(uuid.uuid4().hex, "m", sampling, prompt_token_ids=PROMPT, n=2)
        await harness.send(warm)
        await harness.replies(warm.request_id)  # choice 0's end (1 waits for the only seat)
        await until(lambda: not worker.in_flight)
        assert sum(server.finished_per_second.values()) == 2  # one per choice
        seat_s = sum(server.seat_ms.values()) / 1000 / 2
        assert seat_s > 0  # each held the slot for its 64 steps (the second for 128)
        stats = engine.stats()
        assert stats["step_time_s"] > 0 and stats["max_num_seqs"] == 1
        assert (stats["waiting_tokens"], stats["waiting_blocks"]) == (0, 0)
        assert worker.heartbeat().queue_ms == 0.0  # idle: no queue, a seat free
        assert worker.heartbeat().max_model_len == stats["max_model_len"] > 0

        for _ in range(4):
            request = protocol.Request(uuid.uuid4().hex, "m", sampling, prompt_token_ids=PROMPT)
            await harness.send(request)
        await until(lambda: engine.stats().get("num_waiting", 0) >= 2)
        beat = worker.heartbeat()
        stats = engine.stats()
        head_ms = (time.monotonic() - stats["oldest_waiting_arrival"]) * 1000
        assert beat.num_waiting >= 2 and stats["waiting_tokens"] >= 2 * len(PROMPT)
        # The slot is taken and two or more wait: three or more finishes ahead, each about as
        # long as the warm-up's took (unless the window's finish count says they come
        # slower), while the head has waited a step or two.
        assert beat.queue_ms >= 3 * seat_s * 1000 * 0.99, (beat.queue_ms, seat_s)
        assert beat.queue_ms > head_ms, (beat.queue_ms, head_ms)

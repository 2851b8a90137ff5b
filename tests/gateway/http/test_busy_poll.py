"""``poll_while`` keeps the loop turning (spending CPU, not sleeping) only while it should."""

from __future__ import annotations

import asyncio
import time

import pytest

from sluicegate.gateway.http.busy_poll import poll_while


async def test_it_polls_until_the_work_is_done_then_stops() -> None:
    loop = asyncio.get_running_loop()
    work = loop.create_future()
    loop.call_later(0.1, work.set_result, None)
    started = time.process_time()
    poll_while(work, 5.0)
    await work
    polled = time.process_time() - started
    await asyncio.sleep(0.2)
    after = time.process_time() - started - polled
    assert polled > 0.05, "the loop slept instead of polling"
    assert after < 0.05, "the loop kept polling after the work was done"


@pytest.mark.parametrize(("window_s", "cpu_at_most_s"), [(0.05, 0.2), (0, 0.05)])
async def test_it_polls_no_longer_than_its_window(window_s: float, cpu_at_most_s: float) -> None:
    work = asyncio.get_running_loop().create_future()
    started = time.process_time()
    poll_while(work, window_s)
    await asyncio.sleep(0.3)
    assert time.process_time() - started < cpu_at_most_s

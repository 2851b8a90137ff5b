"""The KV-event routing score: the longest cached prefix wins, weighed against queue length
and KV pressure; where nobody holds more than the others, the shared stream decides."""

from __future__ import annotations

import time

from sluicegate.engine import protocol
from sluicegate.gateway.providers.engine.kv_routing import choose_worker


def beat(worker: str, kv_usage: float = 0.2) -> protocol.Heartbeat:
    return protocol.Heartbeat(
        worker, "m", "m", "test", time.time(), kv_usage=kv_usage, kv_events=True
    )


WORKERS = {w: beat(w) for w in ("w1", "w2", "w3")}
IDLE = dict.fromkeys(WORKERS, 0)


def test_the_longest_prefix_wins() -> None:
    assert choose_worker({"w1": 2, "w2": 7, "w3": 5}, 8, WORKERS, IDLE) == "w2"
    assert choose_worker({"w3": 1}, 8, WORKERS, IDLE) == "w3"


def test_no_holder_or_equal_holders_leave_it_to_the_shared_stream() -> None:
    assert choose_worker({}, 8, WORKERS, IDLE) is None
    assert choose_worker({"w1": 3, "w2": 3, "w3": 3}, 8, WORKERS, IDLE) is None
    assert choose_worker({"w1": 3}, 0, WORKERS, IDLE) is None


def test_a_busy_holder_loses_to_a_less_busy_one_past_the_slack() -> None:
    # A queued request more weighs a quarter of the prompt's blocks.
    prefix = {"w1": 8, "w2": 2}
    assert choose_worker(prefix, 8, WORKERS, {"w1": 2, "w2": 0, "w3": 0}) == "w1"
    assert choose_worker(prefix, 8, WORKERS, {"w1": 4, "w2": 0, "w3": 0}) == "w2"
    assert choose_worker({"w1": 8, "w2": 6}, 8, WORKERS, {"w1": 2, "w2": 0, "w3": 0}) == "w2"
    # Only a holder with nothing cached is less busy: the shared stream, not it.
    assert choose_worker({"w1": 8}, 8, WORKERS, {"w1": 9, "w2": 0, "w3": 0}) is None


def test_kv_pressure_counts_and_a_full_cache_is_passed_over() -> None:
    pressed = {**WORKERS, "w1": beat("w1", kv_usage=0.9)}
    assert choose_worker({"w1": 8, "w2": 8, "w3": 0}, 8, pressed, IDLE) == "w2"
    full = {**WORKERS, "w1": beat("w1", kv_usage=0.99)}
    assert choose_worker({"w1": 8, "w2": 2}, 8, full, IDLE) == "w2"

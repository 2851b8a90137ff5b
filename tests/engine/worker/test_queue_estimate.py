"""The worker's estimate of how long a new request would wait for its first token (the
heartbeat's ``queue_ms``): each term alone, the floor, the empty case, and the stats the
heartbeat builds it from."""

from __future__ import annotations

from collections import Counter

import pytest

from sluicegate.engine.worker.heartbeat import _recent, queue_state
from sluicegate.engine.worker.queue_estimate import (
    FINISH_WINDOW_S,
    QueueState,
    prefill_wait_ms,
    queue_ms,
    seat_wait_ms,
    seats_short,
)

IDLE = QueueState(
    num_running=2,
    max_num_seqs=8,
    kv_blocks_total=100,
    kv_blocks_used=20,
    token_budget=512,
    step_time_s=0.02,
    finishes_per_s=4.0,
)
"""Two requests running, six slots and 80 blocks free, no queue."""


def at(**changes: object) -> QueueState:
    return QueueState(**{**IDLE.__dict__, **changes})  # type: ignore[arg-type]


def test_no_queue_and_a_free_seat_is_zero() -> None:
    assert queue_ms(IDLE) == 0.0
    assert queue_ms(QueueState()) == 0.0  # nothing known, nothing running
    # A queue that fits at once still costs its prefill steps, nothing more.
    state = at(num_waiting=3, waiting_blocks=6, prefill_tokens=90)
    assert seats_short(state) == 0 and seat_wait_ms(state) == 0.0
    assert queue_ms(state) == pytest.approx(20.0)  # one step of 510 tokens


def test_slots_ahead_wait_for_running_requests_to_finish() -> None:
    # Eight running, none free: the new request is the first waiting one's successor.
    full = at(num_running=8, num_waiting=1, waiting_blocks=1)
    assert seats_short(full) == 2
    assert seat_wait_ms(full) == pytest.approx(2 / 4.0 * 1000)
    # Twice the finish rate, half the wait; more waiting, more seats short.
    assert seat_wait_ms(at(num_running=8, num_waiting=1, finishes_per_s=8.0)) == 250.0
    assert seats_short(at(num_running=8, num_waiting=3)) == 4
    # Free slots absorb the queue first.
    assert seats_short(at(num_running=6, num_waiting=2)) == 1


def test_no_finish_in_the_window_counts_as_one_per_window() -> None:
    state = at(num_running=8, finishes_per_s=0.0)
    assert seats_short(state) == 1
    assert seat_wait_ms(state) == pytest.approx(FINISH_WINDOW_S * 1000)


def test_a_quiet_engine_frees_seats_as_fast_as_its_requests_run() -> None:
    # One finish a second because one request a second arrives, each holding its slot for
    # 50 ms: the request running now frees the only slot in about 50 ms, not a second.
    state = at(num_running=1, max_num_seqs=1, finishes_per_s=1.0, seat_time_s=0.05)
    assert seat_wait_ms(state) == pytest.approx(50.0)
    # Eight running at 0.5 s each free 16 slots a second, more than the 4 seen lately.
    assert seat_wait_ms(at(num_running=8, seat_time_s=0.5)) == pytest.approx(62.5)
    # The observed rate stands where it is the faster one.
    assert seat_wait_ms(at(num_running=8, seat_time_s=10.0)) == pytest.approx(250.0)


def test_kv_room_short_waits_for_a_running_share_of_blocks() -> None:
    # Slots are free but the queue's prompts need 30 blocks and 10 are free: the rest (and
    # one for the new request) comes from running requests holding 45 blocks each.
    state = at(num_running=2, kv_blocks_used=90, num_waiting=1, waiting_blocks=30)
    assert seats_short(state) == 1  # ceil(21 / 45)
    state = at(num_running=2, kv_blocks_used=90, num_waiting=1, waiting_blocks=60)
    assert seats_short(state) == 2  # ceil(51 / 45)
    assert seat_wait_ms(state) == pytest.approx(500.0)
    # Never more finishes than there are running requests.
    assert seats_short(at(num_running=2, kv_blocks_used=90, waiting_blocks=10_000)) == 2
    # The new request needs a block of its own: a cache with none free is short.
    assert seats_short(at(kv_blocks_used=100)) == 1
    # Nothing running: nothing to wait for (the scheduler evicts cached blocks instead).
    assert seats_short(at(num_running=0, kv_blocks_used=100, waiting_blocks=500)) == 0


def test_unknown_limits_never_make_a_seat_short() -> None:
    assert seats_short(QueueState(num_running=300, num_waiting=40, kv_blocks_used=9)) == 0


def test_prefill_ahead_takes_steps_of_the_budget_left_by_decodes() -> None:
    # 2 decodes leave 510 tokens a step: 5000 prompt tokens are 10 steps of 20 ms.
    state = at(num_waiting=4, waiting_blocks=40, prefill_tokens=5000)
    assert prefill_wait_ms(state) == pytest.approx(200.0)
    assert queue_ms(state) == pytest.approx(200.0)
    assert prefill_wait_ms(at(prefill_tokens=5000, step_time_s=0.04)) == pytest.approx(400.0)
    # A budget all taken by decodes still moves a token a step.
    state = at(num_running=600, token_budget=512, prefill_tokens=3)
    assert prefill_wait_ms(state) == pytest.approx(60.0)
    # No step measured yet: no figure from prefill.
    assert prefill_wait_ms(at(prefill_tokens=5000, step_time_s=0.0)) == 0.0


def test_the_estimate_is_the_larger_term_and_never_under_the_heads_wait() -> None:
    both = at(num_running=8, num_waiting=1, prefill_tokens=5000)
    assert queue_ms(both) == max(seat_wait_ms(both), prefill_wait_ms(both)) == 500.0
    # A head that has waited longer than the terms say is the figure.
    assert queue_ms(at(num_running=8, num_waiting=1, head_age_s=2.5)) == pytest.approx(2500.0)
    assert queue_ms(at(num_waiting=1, head_age_s=0.3)) == pytest.approx(300.0)
    # A burst that just arrived is long at once, before its head has waited at all.
    assert queue_ms(at(num_running=8, num_waiting=20, head_age_s=0.0)) > 5000.0


def test_the_heartbeat_reads_the_estimate_from_engine_stats() -> None:
    stats = {
        "num_running": 8,
        "num_waiting": 3,
        "num_pending": 1,
        "max_num_seqs": 8,
        "kv_blocks_total": 100,
        "kv_blocks_used": 40,
        "waiting_blocks": 12,
        "waiting_tokens": 180,
        "prefill_tokens_running": 20,
        "max_num_batched_tokens": 512,
        "step_time_s": 0.03,
        "oldest_waiting_arrival": 99.5,
    }
    state = queue_state(stats, 2.0, now=100.0, seat_time_s=8.0)
    assert state == QueueState(
        num_running=8,
        num_waiting=4,
        max_num_seqs=8,
        kv_blocks_total=100,
        kv_blocks_used=40,
        waiting_blocks=12,
        prefill_tokens=200,
        token_budget=512,
        step_time_s=0.03,
        finishes_per_s=2.0,
        seat_time_s=8.0,
        head_age_s=0.5,
    )
    assert queue_ms(state) == pytest.approx(5 / 2.0 * 1000)
    # An engine not started yet reports nothing: no queue.
    assert queue_ms(queue_state({}, 0.0, now=100.0)) == 0.0


def test_recent_counts_the_window_and_drops_older_seconds() -> None:
    per_second = Counter({94: 7, 95: 2, 99: 3, 100: 5})
    assert _recent(per_second, 100.4) == 10
    assert 94 not in per_second and 95 in per_second

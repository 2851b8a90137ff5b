"""How long a request arriving now would wait for its first token on this worker: the
heartbeat's ``queue_ms``, by which a gateway sends a burst's excess to a model's next
deployment (``spill_over: {max_queue_ms: N}``).

Three figures, the largest of which is the estimate:

- **seats**: the new request is admitted after everything waiting (FCFS), so it needs a
  running slot for each waiting request and itself beyond the free ones
  (``max_num_seqs - num_running``), and KV blocks for the waiting prompts and at least one
  of its own beyond the free ones; each missing seat, and each running request's worth of
  missing blocks, is a running request that must finish first. They finish at the rate
  measured over the last few seconds (``FINISH_WINDOW_S``), or faster where the requests
  running now would, at the time the recently finished ones held their slot: a quiet
  engine finishes few requests a second because few arrive, not because they are slow. A
  window without a finish counts as one finish per window.
- **prefill**: the tokens to compute before the new request's own (the waiting prompts,
  preempted requests' outputs, the rest of a prompt still being prefilled in chunks) take
  one step per step budget (``max_num_batched_tokens`` less a token for each running
  decode), each step as long as the recent steps (an EWMA of the engine's step durations).
- **head**: never less than the head of the queue has already waited.

The two estimates overlap in time (earlier prompts prefill while later ones wait for a
seat), hence their maximum rather than their sum. No queue, a free slot and free blocks
(and no prompt mid-prefill) make 0. Pure arithmetic on the engine's counters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FINISH_WINDOW_S = 5.0
"""The window the finish rate (and the heartbeat's tokens/s) is measured over."""


@dataclass(frozen=True)
class QueueState:
    """The engine's load at one instant, as plain numbers."""

    num_running: int = 0
    num_waiting: int = 0
    """Requests queued ahead of a new one (in the scheduler or on their way to it)."""
    max_num_seqs: int = 0
    """Running slots (0: not known, no limit)."""
    kv_blocks_total: int = 0
    """KV blocks in the cache (0: not known, no limit)."""
    kv_blocks_used: int = 0
    waiting_blocks: int = 0
    """KV blocks the waiting requests' tokens need once admitted."""
    prefill_tokens: int = 0
    """Tokens to compute before a new request's own prompt."""
    token_budget: int = 1
    """Tokens one step computes at most (``max_num_batched_tokens``)."""
    step_time_s: float = 0.0
    """Recent duration of one engine step (0: none measured yet)."""
    finishes_per_s: float = 0.0
    """Running requests that finished per second, lately."""
    seat_time_s: float = 0.0
    """How long those requests held a running slot, on average (0: none finished)."""
    head_age_s: float = 0.0
    """How long the head of the queue has waited (0: no queue)."""


def seats_short(state: QueueState) -> int:
    """How many running requests must finish before a new one has a slot and KV room."""
    slots = blocks = 0
    if state.max_num_seqs:
        free_slots = state.max_num_seqs - state.num_running
        slots = max(0, state.num_waiting + 1 - free_slots)
    free_blocks = state.kv_blocks_total - state.kv_blocks_used
    missing_blocks = state.waiting_blocks + 1 - free_blocks
    if state.kv_blocks_total and missing_blocks > 0 and state.num_running:
        # What one finish frees: a running request's share of the blocks in use.
        per_finish = max(1.0, state.kv_blocks_used / state.num_running)
        blocks = min(state.num_running, math.ceil(missing_blocks / per_finish))
    return max(slots, blocks)


def seat_wait_ms(state: QueueState) -> float:
    """Milliseconds until enough running requests finished to seat a new one."""
    short = seats_short(state)
    if not short:
        return 0.0
    rate = max(state.finishes_per_s, 1.0 / FINISH_WINDOW_S)
    if state.seat_time_s > 0 and state.num_running:
        rate = max(rate, state.num_running / state.seat_time_s)
    return short / rate * 1000.0


def prefill_wait_ms(state: QueueState) -> float:
    """Milliseconds of steps to compute the tokens ahead of a new request's own."""
    if state.prefill_tokens <= 0 or state.step_time_s <= 0:
        return 0.0
    per_step = max(1, state.token_budget - state.num_running)
    return math.ceil(state.prefill_tokens / per_step) * state.step_time_s * 1000.0


def queue_ms(state: QueueState) -> float:
    """Milliseconds a request arriving now would wait for its first token (see the module)."""
    return max(seat_wait_ms(state), prefill_wait_ms(state), state.head_age_s * 1000.0, 0.0)

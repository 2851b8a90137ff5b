"""One thread or all of torch's for each CPU product, chosen at start-up by timing both.

On a VM an idle vCPU halts. Where OpenMP's threads sleep between parallel regions
(``OMP_WAIT_POLICY=PASSIVE``, or any policy once its spin runs out), every region pays for
waking the other threads and then for the caller's own sleep at the closing barrier: about
80-100 µs on this project's 2-core VMs, more than most of a decode step's products take on one
thread (SmolLM2 in bfloat16 at 32 rows: the query/key/value product 48 µs on one thread
against 133 µs on two, the output projection 35 against 116, gate/up 203 against 238). Where
the threads spin, the same products run faster on two. So each product shape is timed both
ways at a few row counts, and runs on one thread up to the largest count where that won
(``serial_rows``); the LM head and prefill chunks keep every thread.

The choice changes which thread computes what, not the maths: up to ``CALIBRATION_ROWS[-1]``
rows oneDNN and the packed kernel gave the same bits on one thread as on two in every
SmolLM2 shape tried (at 256 rows and more a bfloat16 oneDNN product may split its sums).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

CALIBRATION_ROWS = (1, 4, 16, 32, 64, 128)
"""Row counts timed, in order, until all threads win."""
_REPEATS = 15
_TOLERANCE = 1.05
_SLACK_S = 2e-6
"""One thread is kept while it takes at most 5 % + 2 µs longer than all: a tie goes to one
thread (no wake-up, the other cores left free), and a few µs are within a VM's noise."""


def on_one_thread(run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``run(x)`` with torch's intra-op threads set to one (the setting is the calling
    thread's own OpenMP one, restored after)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return run(x)
    finally:
        torch.set_num_threads(threads)


def serial_rows(run: Callable[[torch.Tensor], object], width: int, dtype: torch.dtype) -> int:
    """The most rows (of ``CALIBRATION_ROWS``) up to which ``run`` was no slower on one thread
    than on all of torch's, trying counts in order until all threads win; 0 where they win
    at one row, or torch has one thread. ``run`` takes rows of ``width`` values of
    ``dtype``; each count's median of alternating runs decides."""
    if torch.get_num_threads() <= 1:
        return 0
    chosen = 0
    with torch.inference_mode():
        for rows in CALIBRATION_ROWS:
            x = torch.randn(rows, width).to(dtype)
            run(x)  # first call: page faults, oneDNN's JIT
            on_one_thread(run, x)
            serial, parallel = [], []
            for _ in range(_REPEATS):
                serial.append(_seconds(lambda x=x: on_one_thread(run, x)))
                parallel.append(_seconds(lambda x=x: run(x)))
            if statistics.median(serial) > statistics.median(parallel) * _TOLERANCE + _SLACK_S:
                break
            chosen = rows
    return chosen


def _seconds(run: Callable[[], object]) -> float:
    began = time.perf_counter()
    run()
    return time.perf_counter() - began

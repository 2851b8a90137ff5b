"""Polling instead of sleeping while a quiet replica waits a moment for a reply.

A speculative request (``sluicegate.gateway.admission.speculation``) has two replies on their way at once, its
admission's from Redis and its answer's from the upstream, and on a quiet replica nothing else
for the event loop to do meanwhile: it sleeps in ``epoll_wait`` and is woken by the first reply.
On a virtual machine that wake-up is slow (the idle vCPU halts, and the hypervisor must resume
it: tens of µs on the 2-core dev VM, per reply). ``poll_while`` keeps the loop turning, polling
with a zero timeout, until the awaited work is done or a short window passes, so a reply is read
as soon as it lands. It spends CPU only on an otherwise idle replica, and at most the window per
request; a replica under load never speculates, and never polls (bench/gateway_overhead.py
--baseline measured ~3 % less added latency on the dev VM; ``SLUICEGATE_BUSY_POLL_US=0`` turns
it off).
"""

from __future__ import annotations

import asyncio


def poll_while(work: asyncio.Future[object], window_s: float) -> None:
    """Keep the running loop from sleeping until ``work`` is done, or for ``window_s``."""
    if window_s <= 0:
        return
    loop = asyncio.get_running_loop()
    until = loop.time() + window_s

    def turn() -> None:
        if not work.done() and loop.time() < until:
            loop.call_soon(turn)

    loop.call_soon(turn)

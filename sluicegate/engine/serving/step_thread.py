"""The in-process engine's step thread: steps back to back while there is work, and hands
each step's deltas to the asyncio event loop without waiting for it.

The event loop only queues requests, aborts and calls here (thread-safe) and dispatches the
deltas that come back, so its work (the worker's Redis reads and reply writes, the streams'
consumers) runs beside the next step instead of between two steps; the model's kernels
release the GIL. Everything that touches the engine core runs on this thread: queued
requests join, queued aborts land and queued calls run between two steps.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

from sluicegate.engine.kv_events.messages import KvEvent
from sluicegate.engine.serving.core import EngineCore
from sluicegate.engine.serving.core_steps import PendingRequest, abort_all, abort_delta, apply
from sluicegate.engine.serving.request_delta import RequestDelta

logger = logging.getLogger(__name__)

Errors = list[tuple[str, ValueError]]
Deliver = Callable[[list[RequestDelta], Errors, dict[str, Any]], None]
"""Called on the event loop with a step's deltas, the requests it refused, and the stats."""


class StepThread:
    def __init__(
        self,
        core: EngineCore,
        loop: asyncio.AbstractEventLoop,
        deliver: Deliver,
        failed: Callable[[Exception], None],
        kv_events: Callable[[list[KvEvent]], None] | None = None,
    ) -> None:
        """``failed`` is called on the event loop when a step raised: every request in flight
        was aborted in the engine, and their streams should end with the error; ``kv_events``
        with each step's prefix-cache changes, in step order."""
        self._core = core
        self._loop = loop
        self._deliver = deliver
        self._failed = failed
        self._kv_events = kv_events
        self._lock = threading.Lock()
        self._work = threading.Event()
        self._pending: list[PendingRequest] = []
        self._aborts: set[str] = set()
        self._calls: list[tuple[Callable[[], Any], asyncio.Future[Any]]] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)
        self._done: asyncio.Future[None] = loop.create_future()

    def start(self) -> None:
        self._thread.start()

    async def stop(self) -> None:
        """Let the step in progress finish, then end the thread (queued work is dropped)."""
        with self._lock:
            self._stopping = True
        self._work.set()
        await self._done

    # -- from the event loop ----------------------------------------------------------------

    def add(self, request: PendingRequest) -> None:
        with self._lock:
            self._pending.append(request)
        self._work.set()

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.add(request_id)
        self._work.set()

    def wake(self) -> None:
        """Look again at the queued requests (a grammar finished compiling)."""
        self._work.set()

    def call(self, function: Callable[[], Any]) -> asyncio.Future[Any]:
        """Run ``function`` on this thread between two steps; its result or exception."""
        future = self._loop.create_future()
        with self._lock:
            self._calls.append((function, future))
        self._work.set()
        return future

    def num_pending(self) -> int:
        """Requests queued here that have not joined the scheduler yet."""
        return len(self._pending)

    # -- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._turn():
                pass
        finally:
            self._post(self._done.set_result, None)

    def _turn(self) -> bool:
        """One pass: take what was queued, run one step if there is work, hand over its
        deltas; sleep when there is nothing to do. False once stopping."""
        self._work.clear()
        with self._lock:
            if self._stopping:
                return False
            calls, self._calls = self._calls, []
            aborts, self._aborts = self._aborts, set()
            # Requests aborted while their grammar compiles never reach the engine.
            dropped = [p for p in self._pending if not p.ready and p.request_id in aborts]
            ready = [p for p in self._pending if p.ready]
            self._pending = [p for p in self._pending if not p.ready and p not in dropped]
        for function, future in calls:
            self._settle(future, function)
        aborts.difference_update(p.request_id for p in dropped)
        deltas = [abort_delta(p.request_id) for p in dropped]
        errors: Errors = []
        core = self._core
        if ready or aborts or core.has_unfinished():
            try:
                applied, errors = apply(core, ready, aborts)
                deltas += applied
                if core.has_unfinished():
                    deltas += core.step()
            except Exception as exc:  # a failed step leaves no request in a known state
                logger.exception("engine step failed; failing every request in flight")
                abort_all(core)
                self._post(self._failed, exc)
                return True
        kv_events = core.take_kv_events()
        if kv_events and self._kv_events is not None:
            self._post(self._kv_events, kv_events)
        if deltas or errors or ready or aborts:
            self._post(self._deliver, deltas, errors, core.stats())
        if not core.has_unfinished():
            self._work.wait()
        return True

    def _settle(self, future: asyncio.Future[Any], function: Callable[[], Any]) -> None:
        try:
            result = function()
        except Exception as exc:
            self._post(_set_exception, future, exc)
        else:
            self._post(_set_result, future, result)

    def _post(self, callback: Callable[..., None], *args: Any) -> None:
        self._loop.call_soon_threadsafe(callback, *args)


def _set_result(future: asyncio.Future[Any], result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future[Any], exc: Exception) -> None:
    if not future.done():
        future.set_exception(exc)

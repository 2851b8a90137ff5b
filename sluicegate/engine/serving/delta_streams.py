"""Each in-flight request's deltas on their way to the asyncio caller reading them: one
queue per request, and the iterator over it that aborts the request if left early."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from sluicegate.engine.serving.request_delta import RequestDelta


class DeltaStreams:
    def __init__(self, abort: Callable[[str], None]) -> None:
        self._queues: dict[str, asyncio.Queue[RequestDelta | BaseException]] = {}
        self._abort = abort

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._queues

    def __len__(self) -> int:
        return len(self._queues)

    def request_ids(self) -> list[str]:
        return list(self._queues)

    def open(self, request_id: str) -> AsyncIterator[RequestDelta]:
        """Register the request; its deltas (or the error that ends it) come out here."""
        queue: asyncio.Queue[RequestDelta | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        return self._stream(request_id, queue)

    def dispatch(self, deltas: list[RequestDelta]) -> None:
        for delta in deltas:
            queue = self._queues.get(delta.request_id)
            if queue is None:
                continue
            queue.put_nowait(delta)
            if delta.done:
                del self._queues[delta.request_id]

    def fail(self, request_id: str, error: BaseException) -> None:
        queue = self._queues.pop(request_id, None)
        if queue is not None:
            queue.put_nowait(error)

    async def _stream(
        self, request_id: str, queue: asyncio.Queue[RequestDelta | BaseException]
    ) -> AsyncIterator[RequestDelta]:
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.done
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._abort(request_id)

"""One reader per gateway replica for the replies of all its engine requests.

Workers write every delta of a request to the stream named in its ``reply_to``. Giving all
requests of one provider the same reply stream lets a single blocking XREAD fetch the deltas
of many requests per round trip, instead of one blocked connection per request. The reader
hands each message to the queue of its request; a Redis failure is delivered to every waiting
request as ``TRANSPORT_DOWN`` so none waits for a reply that cannot come.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from engine import protocol

logger = logging.getLogger(__name__)

TRANSPORT_DOWN = object()
"""Put on every open queue when the reply stream cannot be read."""

ReplyQueue = asyncio.Queue[Any]


class ReplyReader:
    def __init__(self, redis: Redis, stream: str, block_ms: int = 1000) -> None:
        self.redis = redis
        self.stream = stream
        self.block_ms = block_ms
        self._queues: dict[str, ReplyQueue] = {}
        self._task: asyncio.Task[None] | None = None
        self._last_id: bytes | str = "0-0"

    def open(self, request_id: str) -> ReplyQueue:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name=f"replies {self.stream}")
        queue: ReplyQueue = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None

    async def _run(self) -> None:
        delay = 0.0
        while True:
            try:
                reply = await self.redis.xread(
                    {self.stream: self._last_id}, count=1000, block=self.block_ms
                )
            except (RedisError, OSError) as exc:
                if not delay:
                    logger.warning("reading %s failed: %s", self.stream, exc)
                for queue in self._queues.values():
                    queue.put_nowait(TRANSPORT_DOWN)
                if not self._queues:
                    return
                delay = min(1.0, max(0.05, delay * 2))
                await asyncio.sleep(delay)
                continue
            delay = 0.0
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    self._last_id = entry_id
                    self._dispatch(fields)
            if not self._queues:
                # Idle: stop holding a blocked connection; the next request restarts us.
                return

    def _dispatch(self, fields: dict[Any, Any]) -> None:
        raw = fields.get(protocol.MESSAGE_FIELD)
        if raw is None:
            raw = fields.get(protocol.MESSAGE_FIELD.decode())
        try:
            message = protocol.decode(raw if isinstance(raw, bytes) else b"")
        except protocol.MalformedMessage as exc:
            logger.warning("ignoring malformed reply on %s: %s", self.stream, exc)
            return
        for part in message.messages if isinstance(message, protocol.Batch) else [message]:
            queue = self._queues.get(getattr(part, "request_id", ""))
            if queue is not None:
                queue.put_nowait(part)

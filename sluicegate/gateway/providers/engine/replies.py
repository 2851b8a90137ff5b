"""One reader per gateway replica for the replies of all its engine requests.

Workers write every delta of a request to the stream named in its ``reply_to``. Giving all
requests of one provider the same reply stream lets a single blocking read fetch the deltas
of many requests per round trip, instead of one blocked connection per request. The reader
hands each message to the queue of its request; a Redis failure is delivered to every waiting
request as ``TRANSPORT_DOWN`` so none waits for a reply that cannot come.

It reads as the one consumer of the consumer group ``REPLY_GROUP`` with ``NOACK`` (no pending
list), so Redis itself keeps, at no extra round trip, how far this replica has read: the
group's last-delivered id. Should the replica die, a peer's reaper (``sluicegate.gateway.leases.reaper``)
bills each of its streams the tokens of the deltas read up to there. The group is created
with the stream (MKSTREAM, at id 0, with the workers' TTL) on first use; workers let an idle
reply stream expire, and the XADD of a later reply creates it again without the group: the
read answers NOGROUP and the group is made again at id 0, so that reply is read too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from sluicegate.engine import protocol, redis_names

logger = logging.getLogger(__name__)

REPLY_GROUP = "gateway"
"""The consumer group a replica reads its reply stream as (its only consumer)."""
REPLY_TTL_S = 120
"""What the workers give a reply stream (``sluicegate.engine.worker.replies``): the same for one the
reader creates, which no worker may ever write to."""

TRANSPORT_DOWN = object()
"""Put on every open queue when the reply stream cannot be read."""

ReplyQueue = asyncio.Queue[Any]

READER = "reader"
"""The group's one consumer (a reply stream is one provider's of one replica)."""


def _group_gone(exc: ResponseError) -> bool:
    """The reply stream (and so its group) is gone: NOGROUP for a read that found no group, or
    a blocked read unblocked because the stream was deleted under it."""
    text = str(exc)
    return "NOGROUP" in text or "no longer exists" in text


class ReplyReader:
    def __init__(self, redis: Redis, stream: str, block_ms: int = 1000) -> None:
        self.redis = redis
        self.stream = stream
        self.block_ms = block_ms
        self._queues: dict[str, ReplyQueue] = {}
        self._task: asyncio.Task[None] | None = None
        self._grouped = False
        """Whether the group is known to exist (made, or read through)."""
        self._stopping = False

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
            # The flag too: redis-py (8.1) can swallow a cancellation that lands in a blocked
            # read as it times out, and the loop would read on; it stops at its next turn.
            self._stopping = True
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
            self._stopping = False

    async def _make_group(self) -> None:
        """The group, at id 0 so that entries written before it are read too (a worker's XADD
        that recreated the stream); BUSYGROUP: it exists already."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.xgroup_create(self.stream, REPLY_GROUP, id="0", mkstream=True)
        # Only a stream MKSTREAM just made has no TTL; the workers' XADDs refresh it.
        pipe.expire(self.stream, REPLY_TTL_S, nx=True)
        created, _ = await pipe.execute(raise_on_error=False)
        if isinstance(created, Exception) and "BUSYGROUP" not in str(created):
            raise created
        self._grouped = True

    async def _read(self) -> Any:
        if not self._grouped:
            await self._make_group()
        try:
            return await self.redis.xreadgroup(
                REPLY_GROUP,
                READER,
                {self.stream: ">"},
                count=1000,
                block=self.block_ms,
                noack=True,
            )
        except ResponseError as exc:
            if not _group_gone(exc):
                raise
        # The stream expired (and maybe came back with a worker's reply): make the group again.
        self._grouped = False
        await self._make_group()
        return None

    async def _run(self) -> None:
        delay = 0.0
        while not self._stopping:
            try:
                reply = await self._read()
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
                for _, fields in entries:
                    self._dispatch(fields)
            if not self._queues:
                # Idle: stop holding a blocked connection; the next request restarts us.
                return

    def _dispatch(self, fields: dict[Any, Any]) -> None:
        raw = fields.get(redis_names.MESSAGE_FIELD)
        if raw is None:
            raw = fields.get(redis_names.MESSAGE_FIELD.decode())
        try:
            message = protocol.decode(raw if isinstance(raw, bytes) else b"")
        except protocol.MalformedMessage as exc:
            logger.warning("ignoring malformed reply on %s: %s", self.stream, exc)
            return
        for part in message.messages if isinstance(message, protocol.Batch) else [message]:
            queue = self._queues.get(getattr(part, "request_id", ""))
            if queue is not None:
                queue.put_nowait(part)

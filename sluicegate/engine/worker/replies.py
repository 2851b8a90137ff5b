"""Reply writing: every queued reply, started mark, produced-token record and XACK goes out
in one pipelined round trip per batch, so the serving side never waits on Redis."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from sluicegate.engine import protocol, redis_names
from sluicegate.engine.worker.options import Backoff

_REPLY_TTL_S = 120
_REPLY_MAXLEN = 100_000
_STARTED_TTL_S = 3600
_PRODUCED_TTL_S = 600


@dataclass
class Write:
    """One reply to publish; ``ack`` marks the request's entry done once it is written."""

    reply_to: str
    message: protocol.Delta | protocol.Error | None
    batchable: bool = False
    """The request's gateway reads ``Batch`` entries (protocol version 2 and later)."""
    started_key: str | None = None
    ack: tuple[str, bytes] | None = None


class ReplyWriter:
    def __init__(self, redis: aioredis.Redis, worker_id: str) -> None:
        self.redis = redis
        self.worker_id = worker_id
        self.queue: asyncio.Queue[Write] = asyncio.Queue()
        self.unacked: dict[tuple[str, bytes], None] = {}
        """Entries answered (or dropped) whose XACK is not written yet: still vouched for, or
        another worker would take over a request this one already answered."""
        self.produced: dict[str, dict[str, Any]] = {}
        """Produced-token records due to be written (``redis_names.produced_key``)."""
        self._expired_at: dict[str, float] = {}
        """When each reply stream's TTL was last refreshed."""

    def put(self, write: Write) -> None:
        if write.ack is not None:
            self.unacked[write.ack] = None
        self.queue.put_nowait(write)

    def ack_now(self, stream: str, entry_id: bytes) -> None:
        """Acknowledge an entry served by nobody (malformed, duplicate, cancelled)."""
        self.put(Write("", None, False, None, (stream, entry_id)))

    async def join(self) -> None:
        await self.queue.join()

    async def run(self) -> None:
        """Publish every queued reply in one pipelined round trip per batch."""
        backoff = Backoff()
        while True:
            batch = [await self.queue.get()]
            while not self.queue.empty():
                batch.append(self.queue.get_nowait())
            while True:
                try:
                    await self._write_batch(batch)
                    backoff.reset()
                    break
                except (RedisError, OSError) as exc:
                    await backoff.wait("write", exc)
            for _ in batch:
                self.queue.task_done()

    async def _write_batch(self, batch: list[Write]) -> None:
        now = time.monotonic()
        if len(self._expired_at) > 10_000:
            self._expired_at = {k: t for k, t in self._expired_at.items() if now - t < _REPLY_TTL_S}
        pipe = self.redis.pipeline(transaction=False)
        refreshed: list[str] = []
        replies: dict[str, list[protocol.Delta | protocol.Error]] = {}
        batchable: dict[str, bool] = {}
        for write in batch:
            if write.started_key:
                pipe.set(write.started_key, self.worker_id, ex=_STARTED_TTL_S)
            if write.message is not None:
                replies.setdefault(write.reply_to, []).append(write.message)
                batchable[write.reply_to] = batchable.get(write.reply_to, True) and write.batchable
        for reply_to, messages in replies.items():
            if len(messages) > 1 and batchable[reply_to]:
                payloads = [protocol.encode(protocol.Batch(messages))]
            else:
                payloads = [protocol.encode(m) for m in messages]
            for payload in payloads:
                pipe.xadd(
                    reply_to,
                    {redis_names.MESSAGE_FIELD: payload},
                    maxlen=_REPLY_MAXLEN,
                    approximate=True,
                )
            if now - self._expired_at.get(reply_to, 0.0) > _REPLY_TTL_S / 10:
                pipe.expire(reply_to, _REPLY_TTL_S)
                refreshed.append(reply_to)
        produced, self.produced = self.produced, {}
        for request_id, record in produced.items():
            pipe.hset(redis_names.produced_key(request_id), mapping=record)
            pipe.expire(redis_names.produced_key(request_id), _PRODUCED_TTL_S)
        for write in batch:
            if write.ack:
                stream, entry_id = write.ack
                pipe.xack(stream, redis_names.REQUEST_GROUP, entry_id)
                pipe.xdel(stream, entry_id)
        try:
            await pipe.execute()
        except (RedisError, OSError):
            self.produced = {**produced, **self.produced}  # newer records win
            raise
        for write in batch:
            if write.ack:
                self.unacked.pop(write.ack, None)
        for reply_to in refreshed:
            self._expired_at[reply_to] = now

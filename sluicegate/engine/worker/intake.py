"""Pulling and claiming: new entries from the model's stream and this worker's own stream
(only as many as the engine has room for), and entries of dead workers taken over; and the
commands on this worker's control stream (LoRA loads and unloads), each answered."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from sluicegate.engine import protocol, redis_names
from sluicegate.engine.worker.admission import entry_field
from sluicegate.engine.worker.options import Backoff, WorkerOptions, text

logger = logging.getLogger("sluicegate.worker")

Admit = Callable[[str, bytes, Any, bool], Awaitable[None]]
"""Serve one entry: (stream, entry id, its fields, whether it was taken over)."""
Control = Callable[[protocol.LoadLora | protocol.UnloadLora], Awaitable[protocol.ControlReply]]
"""Carry out one control command; its answer."""


class Intake:
    def __init__(
        self,
        redis: aioredis.Redis,
        options: WorkerOptions,
        room_for: Callable[[], int],
        admit: Admit,
        room: asyncio.Event,
        draining: Callable[[], bool],
        control: Control | None = None,
    ) -> None:
        self.redis = redis
        self.options = options
        self.room_for = room_for
        """How many requests to pull now (0 while draining or full)."""
        self.admit = admit
        self.room = room
        """Set whenever the engine may have room again (a step ran, a request ended)."""
        self.draining = draining
        self.control = control
        model = options.model_name
        self.control_stream = redis_names.control_stream(model, options.worker_id)
        self.shared_stream = redis_names.request_stream(model)
        self.own_stream = redis_names.worker_stream(model, options.worker_id)

    async def ensure_groups(self) -> None:
        for stream in (self.shared_stream, self.own_stream):
            try:
                await self.redis.xgroup_create(
                    stream, redis_names.REQUEST_GROUP, id="0", mkstream=True
                )
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def pull_loop(self) -> None:
        backoff = Backoff()
        while True:
            count = self.room_for()
            if count == 0:
                # Woken after every engine step (deltas) and every finished request, when
                # the engine may have admitted what waited; the timeout covers steps that
                # produce no delta (a long prefill in chunks).
                self.room.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.room.wait(), 0.02)
                continue
            try:
                reply = await self.redis.xreadgroup(
                    redis_names.REQUEST_GROUP,
                    self.options.worker_id,
                    {self.shared_stream: ">", self.own_stream: ">"},
                    count=count,
                    block=500,
                )
                backoff.reset()
            except ResponseError as exc:
                if "NOGROUP" in str(exc):
                    # Redis lost its data (restart without persistence): start over.
                    await self._recreate_groups(backoff)
                    continue
                raise
            except (RedisError, OSError) as exc:
                await backoff.wait("pull", exc)
                continue
            for stream, entries in reply or []:
                for entry_id, fields in entries:
                    await self.admit(text(stream), entry_id, fields, False)

    async def control_loop(self) -> None:
        """Commands on this worker's control stream, one at a time, in order; each is
        answered on its ``reply_to`` stream and deleted (read from the start, so a command
        sent while the worker started is not missed)."""
        backoff = Backoff()
        last_id = "0-0"
        while True:
            try:
                reply = await self.redis.xread({self.control_stream: last_id}, count=16, block=500)
                backoff.reset()
                for _, entries in reply or []:
                    for entry_id, fields in entries:
                        await self._answer(fields)
                        await self.redis.xdel(self.control_stream, entry_id)
                        last_id = text(entry_id)
            except (RedisError, OSError) as exc:
                await backoff.wait("control", exc)

    async def _answer(self, fields: Any) -> None:
        raw = entry_field(fields, redis_names.MESSAGE_FIELD)
        try:
            command = protocol.decode(raw) if raw is not None else None
        except protocol.MalformedMessage as exc:
            logger.warning("control stream: a malformed command dropped (%s)", exc)
            return
        if not isinstance(command, protocol.LoadLora | protocol.UnloadLora):
            logger.warning("control stream: %s is not a command; dropped", type(command).__name__)
            return
        if self.control is None:
            answer = protocol.ControlReply(self.options.worker_id, False, "no control here")
        else:
            answer = await self.control(command)
        await self.redis.xadd(
            command.reply_to, {redis_names.MESSAGE_FIELD: protocol.encode(answer)}
        )

    async def _recreate_groups(self, backoff: Backoff) -> None:
        try:
            await self.ensure_groups()
        except (RedisError, OSError) as exc:
            await backoff.wait("recreate groups", exc)

    async def claim_loop(self) -> None:
        backoff = Backoff()
        while True:
            await asyncio.sleep(self.options.heartbeat_interval_s)
            try:
                await self._claim_dead_workers_entries()
                backoff.reset()
            except ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    logger.exception("claim failed")
                await self._recreate_groups(backoff)
            except (RedisError, OSError) as exc:
                await backoff.wait("claim", exc)

    async def _claim_dead_workers_entries(self) -> None:
        min_idle_ms = int(self.options.claim_idle_s * 1000)
        if self.draining():
            return
        # Even a full worker takes one a second: a dead worker's requests must not wait for
        # room that may never come, and those that had streamed only need an error reply.
        count = max(1, self.room_for())
        streams = [self.shared_stream, *await self._dead_worker_streams()]
        for stream in streams:
            reply = await self.redis.xautoclaim(
                stream,
                redis_names.REQUEST_GROUP,
                self.options.worker_id,
                min_idle_time=min_idle_ms,
                start_id="0-0",
                count=count,
            )
            for entry_id, fields in reply[1] if len(reply) > 1 else []:
                if fields is None:
                    await self.redis.xack(stream, redis_names.REQUEST_GROUP, entry_id)
                    continue
                await self.admit(stream, entry_id, fields, True)
            if stream != self.shared_stream:
                await self._take_unread_entries(stream, count)

    async def _dead_worker_streams(self) -> list[str]:
        model = self.options.model_name
        registry = redis_names.worker_registry(model)
        members = [text(m) for m in await self.redis.smembers(registry)]
        others = [m for m in members if m != self.options.worker_id]
        if not others:
            return []
        alive = await self.redis.mget([redis_names.heartbeat_key(model, m) for m in others])
        return [
            redis_names.worker_stream(model, wid)
            for wid, beat in zip(others, alive, strict=True)
            if beat is None
        ]

    async def _take_unread_entries(self, stream: str, count: int) -> None:
        """Serve what was routed to a dead worker but never read; forget its stream once empty."""
        try:
            reply = await self.redis.xreadgroup(
                redis_names.REQUEST_GROUP, self.options.worker_id, {stream: ">"}, count=count
            )
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            reply = []
        entries = [e for _, batch in reply or [] for e in batch]
        for entry_id, fields in entries:
            await self.admit(stream, entry_id, fields, True)
        if entries:
            return
        pending = await self._pending_count(stream)
        if pending == 0 and await self.redis.xlen(stream) == 0:
            dead = stream.rsplit(":w:", 1)[1]
            pipe = self.redis.pipeline(transaction=False)
            pipe.delete(stream)
            pipe.srem(redis_names.worker_registry(self.options.model_name), dead)
            await pipe.execute()

    async def _pending_count(self, stream: str) -> int:
        try:
            summary = await self.redis.xpending(stream, redis_names.REQUEST_GROUP)
        except ResponseError:
            return 0
        return int(summary.get("pending", 0) if isinstance(summary, dict) else summary[0])

"""Cancellation: the gateway publishes ``Cancel`` on the model's channel; a request served
here is aborted, and one not here yet is remembered for a while so it is never served."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from sluicegate.engine import protocol, redis_names
from sluicegate.engine.worker.options import Backoff
from sluicegate.engine.worker.serving import Server

logger = logging.getLogger("sluicegate.worker")

_REMEMBER_S = 120
_REMEMBER_MAX = 10_000


class CancelListener:
    def __init__(self, pubsub_redis: aioredis.Redis, model_name: str, server: Server) -> None:
        self.redis = pubsub_redis
        self.channel = redis_names.cancel_channel(model_name)
        self.server = server
        self._recent: dict[str, float] = {}

    def cancelled_early(self, request_id: str) -> bool:
        """Whether the request was cancelled before it reached this worker."""
        return request_id in self._recent

    async def run(self) -> None:
        backoff = Backoff()
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.channel)
                backoff.reset()
                async for message in pubsub.listen():
                    self.on_message(message.get("data"))
            except (RedisError, OSError) as exc:
                await backoff.wait("cancel subscription", exc)
            finally:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(1.0):
                        await pubsub.aclose()

    def on_message(self, data: Any) -> None:
        if not isinstance(data, bytes | bytearray):
            return
        try:
            message = protocol.decode(bytes(data))
        except protocol.MalformedMessage as exc:
            logger.warning("ignoring malformed cancel: %s", exc)
            return
        if not isinstance(message, protocol.Cancel):
            return
        rid = message.request_id
        if rid in self.server.in_flight:
            self.server.engine.abort(rid)
            return
        now = time.monotonic()
        self._recent[rid] = now
        if len(self._recent) > _REMEMBER_MAX:
            cutoff = now - _REMEMBER_S
            self._recent = {k: t for k, t in self._recent.items() if t > cutoff}

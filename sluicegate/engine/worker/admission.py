"""Admission: decode a pulled or taken-over entry and decide its fate — serve it, answer it
with an error (taken over after text was shown, deadline passed), or acknowledge it unserved
(malformed, a duplicate of a request served here, cancelled before it arrived)."""

from __future__ import annotations

import logging
import time
from typing import Any

import redis.asyncio as aioredis

from sluicegate.engine import protocol, redis_names
from sluicegate.engine.worker.cancels import CancelListener
from sluicegate.engine.worker.serving import InFlight, Server

logger = logging.getLogger("sluicegate.worker")


class Admission:
    def __init__(
        self, redis: aioredis.Redis, model_name: str, server: Server, cancels: CancelListener
    ) -> None:
        self.redis = redis
        self.model_name = model_name
        self.server = server
        self.cancels = cancels

    async def admit(self, stream: str, entry_id: bytes, fields: Any, claimed: bool) -> None:
        writer = self.server.writer
        raw = entry_field(fields, redis_names.MESSAGE_FIELD)
        try:
            if raw is None:
                raise protocol.MalformedMessage("entry has no 'm' field")
            message = protocol.decode(raw)
            if not isinstance(message, protocol.Request):
                raise protocol.MalformedMessage(f"expected a request, got {type(message).__name__}")
        except protocol.MalformedMessage as exc:
            logger.warning("dropping malformed entry %s on %s: %s", entry_id, stream, exc)
            writer.ack_now(stream, entry_id)
            return
        rid = message.request_id
        serving = self.server.in_flight.get(rid)
        if serving is not None:
            if serving.entry != (stream, entry_id):
                # A second entry of a request already being served here (a gateway's retried
                # XADD): acknowledged unserved, or another worker would later take it over
                # and fail the live stream with worker_lost.
                logger.warning("dropping duplicate entry %s of request %s", entry_id, rid)
                writer.ack_now(stream, entry_id)
            return
        item = InFlight(message, stream, entry_id, time.monotonic())
        if self.cancels.cancelled_early(rid):
            writer.ack_now(stream, entry_id)
            return
        if claimed:
            logger.info("took over request %s (entry %s on %s)", rid, entry_id, stream)
        if claimed and await self._already_started(message):
            self.server.fail(
                item, "worker_lost", "The engine worker serving this request was lost."
            )
            return
        if message.expired():
            self.server.fail(
                item, "deadline_exceeded", "The request's deadline passed before it ran."
            )
            return
        self.server.start(item)

    async def _already_started(self, request: protocol.Request) -> bool:
        key = redis_names.started_key(self.model_name, request.request_id)
        return bool(await self.redis.exists(key))


def entry_field(fields: Any, name: bytes) -> bytes | None:
    """A stream entry's field, whether the client decodes replies or not."""
    if not isinstance(fields, dict):
        return None
    value = fields.get(name)
    if value is None:
        value = fields.get(name.decode())
    if isinstance(value, str):
        return value.encode("latin-1", errors="replace")
    return value

"""A relayed engine request whose worker may be gone: when to give up, when to resume.

While a request's reply is quiet, ``LivenessWatch.check`` looks (after twice the heartbeat
TTL, so the workers' own claim of a dead worker's entries goes first) whether its worker is
still alive, whether any worker is, and whether a request nobody answered yet is still
queued. A worker lost after text went out is a ``WorkerLost``: ``resumption`` turns the
request into a new attempt that goes on after what was delivered. Redis itself being down is
``transport_down``'s call: a stream that showed text waits a while, one that showed nothing
fails at once.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from redis.asyncio import Redis
from redis.exceptions import RedisError

from sluicegate.engine import protocol, redis_names
from sluicegate.gateway.providers.engine.call import REDIS_TIMEOUT_S, EngineCall, WorkerLost
from sluicegate.gateway.providers.engine.workers import EngineWorkers
from sluicegate.gateway.settings import Settings

logger = logging.getLogger("sluicegate.gateway.providers.engine.provider")

LOST_MESSAGE = "The engine worker serving this request was lost."
_TRANSPORT_GRACE_S = 10.0
"""How long a stream that already showed text waits for Redis to come back."""


class LivenessWatch:
    def __init__(
        self, redis: Redis, model: str, settings: Settings, workers: EngineWorkers
    ) -> None:
        self._redis = redis
        self.model = model
        self.settings = settings
        self.workers = workers

    async def check(self, call: EngineCall, quiet_s: float) -> None:
        """Fail a request whose worker died; the workers' own claim gives them a head start."""
        grace = 2 * self.settings.worker_heartbeat_ttl_s
        if quiet_s < grace:
            return
        try:
            workers = await self.workers.live_workers()
            if not call.attempt_shown and call.entry is not None:
                await self._check_queued(call)
        except (RedisError, OSError, TimeoutError):
            transport_down(call)
            return
        if call.attempt_shown and call.worker_id not in workers:
            raise WorkerLost(LOST_MESSAGE)
        if not call.shown and not workers:
            raise call.error(
                503,
                "no_worker_available",
                f"No engine worker is serving model '{self.model}' right now.",
            )

    async def _check_queued(self, call: EngineCall) -> None:
        """A request no worker answered yet must still be in its stream (workers delete an
        entry only once its request ended); gone means Redis restarted empty: submit again."""
        assert call.entry is not None
        stream, entry_id = call.entry
        async with asyncio.timeout(REDIS_TIMEOUT_S):
            entries = await self._redis.xrange(stream, entry_id, entry_id)
        if not entries:
            raise WorkerLost("The queued request was lost (Redis restarted); submitted again.")


def transport_down(call: EngineCall) -> None:
    """Redis is unreachable. A stream already showing text waits a while for it (the worker
    keeps generating and retries its writes, so nothing is lost when Redis returns); one
    that showed nothing fails at once, and can be retried elsewhere."""
    now = time.monotonic()
    if call.transport_down_since is None:
        call.transport_down_since = now
    if not call.shown or now - call.transport_down_since > _TRANSPORT_GRACE_S:
        raise call.error(503, "service_unavailable", "Lost the connection to Redis.")


def resumption(call: EngineCall, message: protocol.Request, lost: WorkerLost) -> protocol.Request:
    """The request again, as a new attempt that continues after what was delivered; or
    the client's error when it cannot be resumed."""
    if (
        message.n > 1  # the choices' tokens interleave; one resume list cannot hold them
        or call.attempts >= redis_names.MAX_RESUMES
        or call.delivered >= message.sampling.max_tokens
    ):
        raise call.error(502, "worker_lost", str(lost))
    call.attempts += 1
    call.start_attempt()
    logger.warning(
        "resuming %s after %d tokens (attempt %d): %s",
        call.request_id,
        call.delivered,
        call.attempts,
        lost,
    )
    return msgspec.structs.replace(
        message,
        request_id=redis_names.attempt_id(call.request_id, call.attempts),
        resume_token_ids=list(call.token_ids),
    )

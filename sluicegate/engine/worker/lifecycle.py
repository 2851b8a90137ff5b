"""The worker: wires intake, admission, serving, replies, cancels and heartbeats together,
and owns the lifecycle — start, drain on stop (bounded), hand back what is left.

The worker is a consumer in the model's consumer group. It pulls only while the engine has
room (``can_accept``), so load spreads by capacity and a busy worker never hoards requests.
Deltas go to each request's reply stream in one pipelined round trip per batch; a request is
acknowledged when it finishes. Every second it publishes a heartbeat and re-claims its own
in-flight entries (resetting their idle time), so entries idle for longer than a few seconds
belong to a dead worker: any worker may take them over with XAUTOCLAIM. A taken-over request
that had not streamed a token yet is served again from scratch; one that had ends with a
``worker_lost`` error, upon which the gateway resubmits it with the tokens already streamed
(``Request.resume_token_ids``) so its client's stream goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

import redis.asyncio as aioredis

from sluicegate.engine import protocol
from sluicegate.engine.kv_events.publisher import KvEventPublisher
from sluicegate.engine.worker.admission import Admission
from sluicegate.engine.worker.cancels import CancelListener
from sluicegate.engine.worker.heartbeat import Heartbeats
from sluicegate.engine.worker.intake import Intake
from sluicegate.engine.worker.liveness import LivenessThread
from sluicegate.engine.worker.metrics import WorkerMetrics
from sluicegate.engine.worker.options import WorkerOptions
from sluicegate.engine.worker.replies import ReplyWriter
from sluicegate.engine.worker.serving import InFlight, Server

if TYPE_CHECKING:
    from sluicegate.engine.serving.async_engine import AsyncEngine

logger = logging.getLogger("sluicegate.worker")


class Worker:
    def __init__(
        self,
        engine: AsyncEngine,
        redis: aioredis.Redis,
        options: WorkerOptions,
        metrics: WorkerMetrics | None = None,
        pubsub_redis: aioredis.Redis | None = None,
    ) -> None:
        self.engine = engine
        self.redis = redis
        self.options = options
        self.metrics = metrics or WorkerMetrics(options.model_name)
        self._room = asyncio.Event()
        """Set whenever the engine may have room again (a step ran, a request ended)."""
        self._draining = False
        self._tasks: list[asyncio.Task[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self.writer = ReplyWriter(redis, options.worker_id)
        self.server = Server(engine, options, self.writer, self.metrics, self._room)
        # Cancellations are subscribed to on one node of a cluster (``pubsub_client``).
        self.cancels = CancelListener(pubsub_redis or redis, options.model_name, self.server)
        self.admission = Admission(redis, options.model_name, self.server, self.cancels)
        self.intake = Intake(
            redis,
            options,
            self._room_for,
            self.admission.admit,
            self._room,
            lambda: self._draining,
            self._control,
        )
        self.liveness = LivenessThread(
            options.redis_url,
            options.model_name,
            options.worker_id,
            self._in_flight_entries,
            self._entries_taken_over,
            interval_s=options.heartbeat_interval_s,
            ttl_s=options.heartbeat_ttl_s,
        )
        self.kv_events: KvEventPublisher | None = None
        if engine.options.kv_events:
            self.kv_events = KvEventPublisher(
                redis,
                options.model_name,
                options.worker_id,
                engine.options.block_size,
                engine.tokenizer.hf if engine.tokenizer is not None else None,
            )
            engine.on_kv_events = self.kv_events.add
        self.heartbeats = Heartbeats(
            engine, options, self.metrics, self.server, self.liveness, lambda: self._draining
        )
        self.heartbeats.kv_events = self.kv_events

    @property
    def in_flight(self) -> dict[str, InFlight]:
        return self.server.in_flight

    def heartbeat(self) -> protocol.Heartbeat:
        return self.heartbeats.snapshot()

    async def ensure_groups(self) -> None:
        await self.intake.ensure_groups()

    async def run(self, stop: asyncio.Event) -> None:
        self._loop = asyncio.get_running_loop()
        await self.intake.ensure_groups()
        self.heartbeats.publish()
        self.liveness.beat()
        self.liveness.start()
        self._tasks = [
            asyncio.create_task(self.intake.pull_loop(), name="pull"),
            asyncio.create_task(self.intake.claim_loop(), name="claim"),
            asyncio.create_task(self.intake.control_loop(), name="control"),
            asyncio.create_task(self.heartbeats.run(), name="heartbeat"),
            asyncio.create_task(self.cancels.run(), name="cancels"),
            asyncio.create_task(self.writer.run(), name="writes"),
        ]
        if self.kv_events is not None:
            self._tasks.append(asyncio.create_task(self.kv_events.run(), name="kv-events"))
        await stop.wait()
        await self._drain()

    async def _control(
        self, command: protocol.LoadLora | protocol.UnloadLora
    ) -> protocol.ControlReply:
        """Load or unload a LoRA adapter between two engine steps; a failure (LoRA off, a
        missing file, a wrong base model, a rank too high) is a refusal, and serving goes on."""
        worker_id = self.options.worker_id
        try:
            if isinstance(command, protocol.LoadLora):
                await self.engine.load_lora(command.adapter.name, command.adapter.path)
                done = f"loaded {command.adapter.name}"
            else:
                await self.engine.unload_lora(command.name)
                done = f"unloaded {command.name}"
        except ValueError as exc:
            return protocol.ControlReply(worker_id, False, str(exc))
        self.heartbeats.publish()  # the gateway sees the adapters it holds now
        return protocol.ControlReply(worker_id, True, done)

    def _room_for(self) -> int:
        """How many requests to pull now: none unless the engine says it has room, and no
        more than its admission queue takes, so a busy worker leaves work to the others."""
        if self._draining or not self.engine.can_accept():
            return 0
        stats = self.engine.stats()
        queued = int(stats.get("num_waiting", 0) or 0) + int(stats.get("num_pending", 0) or 0)
        return max(1, min(self.options.max_pull, self.engine.accept_limit - queued))

    async def _drain(self) -> None:
        """Stop pulling, let in-flight requests finish (bounded), hand back the rest."""
        self._draining = True
        for task in self._tasks:
            if task.get_name() in {"pull", "claim"}:
                task.cancel()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.options.drain_timeout_s):
                while self.in_flight:
                    self._room.clear()
                    await self._room.wait()
        if self.in_flight:
            logger.warning(
                "drain timeout (%gs) passed with %d requests in flight; handing them back",
                self.options.drain_timeout_s,
                len(self.in_flight),
            )
        for item in list(self.in_flight.values()):
            # Unstarted requests are simply not acknowledged: another worker claims them once
            # their idle time passes. Started ones cannot move; their client gets an error.
            self.server.stop(item)
            if item.started:
                self.server.fail(item, "worker_lost", "The engine worker shut down mid-generation.")
        self.in_flight.clear()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2.0):
                await self.writer.join()
        for task in self._tasks:
            task.cancel()
        # Bounded: a Redis connection torn down mid-command must not keep us from exiting.
        await asyncio.wait(self._tasks, timeout=2.0)
        await asyncio.to_thread(self.liveness.stop)

    def _in_flight_entries(self) -> list[tuple[str, bytes]]:
        # Called from the liveness thread: list() copies atomically under the GIL.
        serving = [item.entry for item in list(self.in_flight.values())]
        return serving + list(self.writer.unacked)

    def _entries_taken_over(self, stream: str, entry_ids: list[bytes]) -> None:
        """From the liveness thread: another worker owns these entries now."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._stop_serving, stream, set(entry_ids))

    def _stop_serving(self, stream: str, entry_ids: set[bytes]) -> None:
        """Stop, silently, the requests another worker took over: it answers them now (as a
        resumption when text was already shown), and two writers would garble the stream."""
        for item in list(self.in_flight.values()):
            if item.stream == stream and item.entry_id in entry_ids:
                rid = item.request.request_id
                logger.warning("request %s was taken over by another worker; stopping it", rid)
                self.server.stop(item)

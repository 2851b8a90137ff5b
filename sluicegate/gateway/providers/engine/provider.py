"""Our engine workers as a provider: requests over Redis Streams, deltas back the same way.

A request is XADDed to the model's stream (read by the workers' consumer group) or, when a
live and not overloaded worker holds the request's prompt prefix in its KV cache (as its KV
events say: kv_routing.py) or, where workers publish none, served the same prompt prefix
recently, to that worker's own stream. Deltas come back on this provider's reply stream (one
reader for all its requests).
The provider never waits blindly: every request has a deadline, a first-token timeout, and a
watch on the heartbeat of the worker serving it. When the client goes away the worker is told
to abort (pub/sub) and a request nobody picked up yet is deleted from its stream.

This module submits requests and relays their replies; engine_workers.py knows the workers
and picks the stream, engine_liveness.py watches a quiet request and resumes a lost one,
engine_call.py holds one request's progress.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from redis.asyncio import Redis
from redis.exceptions import RedisError

from sluicegate.engine import protocol, redis_names
from sluicegate.engine.redis_client import async_client
from sluicegate.gateway.canonical import ChatRequest, Chunk
from sluicegate.gateway.providers.base import ProviderError, unsupported_field
from sluicegate.gateway.providers.engine.call import (
    REDIS_TIMEOUT_S,
    EngineCall,
    WorkerLost,
    redis_down,
)
from sluicegate.gateway.providers.engine.kv_routing import KvRouter
from sluicegate.gateway.providers.engine.liveness import (
    LOST_MESSAGE,
    LivenessWatch,
    resumption,
    transport_down,
)
from sluicegate.gateway.providers.engine.prefix_affinity import prefix_hashes, render_prompt
from sluicegate.gateway.providers.engine.replies import TRANSPORT_DOWN, ReplyReader
from sluicegate.gateway.providers.engine.wire import unsupported, wire_request
from sluicegate.gateway.providers.engine.workers import EngineWorkers
from sluicegate.gateway.settings import Settings

logger = logging.getLogger(__name__)

_LIVENESS_CHECK_S = 1.0

_ERRORS: dict[str, tuple[int, str]] = {
    "context_length_exceeded": (400, "context_length_exceeded"),
    "invalid_request": (400, "invalid_request"),
    "deadline_exceeded": (504, "timeout"),
    "worker_lost": (502, "worker_lost"),
    "overloaded": (503, "overloaded"),
    "internal_error": (500, "engine_error"),
}


def _binary_client(redis: Redis, settings: Settings) -> Redis:
    """Our messages are msgpack: use a client that does not decode replies to str."""
    kwargs = getattr(getattr(redis, "connection_pool", None), "connection_kwargs", {})
    if kwargs.get("decode_responses"):
        return async_client(settings.redis_url, socket_connect_timeout=REDIS_TIMEOUT_S)
    return redis


class EngineProvider:
    def __init__(
        self,
        redis: Redis,
        settings: Settings,
        model: str,
        *,
        name: str | None = None,
        prefix_affinity: bool = True,
    ) -> None:
        self.name = name or f"engine:{model}"
        self.model = model
        self.settings = settings
        self.prefix_affinity = prefix_affinity
        self._redis = _binary_client(redis, settings)
        self._owns_client = self._redis is not redis
        reply_id = f"gw-{settings.instance_id}-{uuid.uuid4().hex[:8]}"
        self._replies = ReplyReader(self._redis, redis_names.reply_stream(reply_id))
        self.workers = EngineWorkers(self._redis, model, settings.worker_heartbeat_ttl_s)
        self.kv_routing = KvRouter(self._redis, model, self.workers)
        self._watch = LivenessWatch(self._redis, model, settings, self.workers)
        self._background: set[asyncio.Task[Any]] = set()

    @property
    def reply_stream(self) -> str:
        """Where this provider's replies come back (``Lease.reply_to``)."""
        return self._replies.stream

    # ---- workers (engine_workers.py) -------------------------------------------------------

    async def live_workers(self) -> dict[str, protocol.Heartbeat]:
        return await self.workers.live_workers()

    async def queue_ms(self) -> float:
        return await self.workers.queue_ms()

    async def is_available(self) -> bool:
        try:
            return bool(await self.live_workers())
        except (RedisError, OSError, TimeoutError):
            return False

    # ---- generation ------------------------------------------------------------------------

    async def generate(self, request: ChatRequest) -> AsyncIterator[Chunk]:
        lora = request.lora
        workers = await self._workers_or_503(lora is not None)
        refusal = self._no_thinking_mode(request, workers)
        if refusal is not None:
            raise refusal
        deadline = request.deadline or time.time() + self.settings.request_timeout_s
        message = wire_request(
            request, self.model, deadline, self._replies.stream, self._default_max_tokens(request)
        )
        rendered = render_prompt(message.messages, request.prompt)
        adapter = lora.name if lora is not None else None
        affinity = self.prefix_affinity and len(workers) > 1
        hashes = prefix_hashes(rendered, adapter=adapter) if affinity else []
        call = EngineCall(request.request_id, deadline, request.sampling.n)
        try:
            stream = await self._pick_stream(message, hashes, workers, adapter)
            while True:
                try:
                    async for chunk in self._attempt(call, message, stream):
                        if call.first_delta:
                            call.first_delta = False
                            self._on_served(call, hashes)
                        yield chunk
                    return
                except WorkerLost as lost:
                    lost_worker = call.worker_id
                    message = resumption(call, message, lost)
                    stream = await self._resume_stream(adapter, lost_worker)
        finally:
            if call.counted_on:
                self.workers.count(call.counted_on, -1)

    async def _pick_stream(
        self,
        message: protocol.Request,
        hashes: list[int],
        workers: dict[str, protocol.Heartbeat],
        adapter: str | None = None,
    ) -> str:
        """By the workers' KV caches where they publish them (requests without an adapter),
        else by text-hash affinity (for an adapter: among the LoRA workers ``workers`` holds)."""
        if adapter is None and self.prefix_affinity and len(workers) > 1:
            blocks = await self.kv_routing.block_hashes(message, workers)
            if blocks is not None:
                worker = await self.kv_routing.pick(blocks, workers, self.workers.load(workers))
                if worker is None:
                    return redis_names.request_stream(self.model)
                return redis_names.worker_stream(self.model, worker)
        return await self.workers.pick_stream(hashes, workers, adapter)

    async def _resume_stream(self, adapter: str | None, lost_worker: str | None) -> str:
        """Where a lost request goes again: the shared stream, or for an adapter another LoRA
        worker's own stream (the shared one may reach a worker without LoRA)."""
        if adapter is None:
            return redis_names.request_stream(self.model)
        workers = await self._workers_or_503(True)
        others = {w: beat for w, beat in workers.items() if w != lost_worker} or workers
        return await self.workers.pick_stream([], others, adapter)

    async def count_tokens(self, request: ChatRequest) -> int:
        """The prompt's tokens as a worker renders it (its chat template, the tools), with
        nothing generated: a count-only request, answered by one final delta. Sent without
        ``lora``, to any worker: an adapter does not change the base model's tokenizer."""
        await self._workers_or_503()
        deadline = request.deadline or time.time() + self.settings.request_timeout_s
        message = wire_request(request, self.model, deadline, self._replies.stream, 1)
        message = msgspec.structs.replace(
            message,
            count_only=True,
            # What a worker from before count_only does instead: a one-token generation.
            sampling=protocol.Sampling(max_tokens=1),
            n=1,
            structured=None,
            lora=None,
        )
        call = EngineCall(request.request_id, deadline)
        async for chunk in self._attempt(call, message, redis_names.request_stream(self.model)):
            if chunk.usage is not None:
                return chunk.usage.prompt_tokens
        return call.prompt_tokens

    async def _attempt(
        self, call: EngineCall, message: protocol.Request, stream: str
    ) -> AsyncIterator[Chunk]:
        """One submission of the request (the first, or a resumption) and its relayed reply."""
        queue = self._replies.open(message.request_id)
        call.entry = None
        try:
            try:
                async with asyncio.timeout(REDIS_TIMEOUT_S):
                    entry_id = await self._redis.xadd(
                        stream, {redis_names.MESSAGE_FIELD: protocol.encode(message)}
                    )
            except (RedisError, OSError, TimeoutError) as exc:
                if call.attempts:
                    raise call.error(502, "worker_lost", LOST_MESSAGE) from exc
                raise redis_down(exc) from exc
            call.entry = (stream, entry_id)
            async for chunk in self._relay(call, queue):
                yield chunk
        finally:
            self._replies.close(message.request_id)
            if not call.finished and call.entry is not None:
                self._spawn(self._cancel(message.request_id, call.entry))

    def _default_max_tokens(self, request: ChatRequest) -> int:
        # OpenAI's default for text completions is 16; chat has no cap there, ours is a setting.
        return self.settings.default_max_tokens if request.messages is not None else 16

    def unsupported(self, request: ChatRequest) -> ProviderError | None:
        return unsupported(request) or self._no_thinking_mode(request, self.workers.seen)

    def _no_thinking_mode(
        self, request: ChatRequest, workers: dict[str, protocol.Heartbeat]
    ) -> ProviderError | None:
        """Anthropic's ``thinking`` asks for the checkpoint's thinking mode: a 400 when the
        workers (as their heartbeats say) serve one without."""
        thinking = request.thinking
        if thinking is None or thinking.type == "disabled" or not workers:
            return None
        if any(beat.thinking for beat in workers.values()):
            return None
        return unsupported_field(
            "thinking", f"The model '{self.model}' has no thinking mode; leave out 'thinking'."
        )

    async def _workers_or_503(self, lora: bool = False) -> dict[str, protocol.Heartbeat]:
        """The live workers (with ``lora``, those with LoRA on), or the 503 for none."""
        try:
            workers = await self.live_workers()
        except (RedisError, OSError, TimeoutError) as exc:
            raise redis_down(exc) from exc
        if lora:
            workers = {w: beat for w, beat in workers.items() if beat.max_loras > 0}
        if not workers:
            serving = "with LoRA adapters enabled " if lora else ""
            raise ProviderError(
                f"No engine worker {serving}is serving model '{self.model}' right now.",
                retryable=True,
                status_code=503,
                code="no_worker_available",
                counts_toward_cooldown=False,
            )
        return workers

    async def _relay(self, call: EngineCall, queue: asyncio.Queue[Any]) -> AsyncIterator[Chunk]:
        taken_by = time.monotonic() + (
            self.settings.resume_timeout_s if call.attempts else self.settings.first_token_timeout_s
        )
        quiet_since = time.monotonic()
        while True:
            now = time.monotonic()
            left = call.deadline - time.time()
            if left <= 0:
                raise call.error(504, "timeout", "The request exceeded its deadline.")
            if not call.attempt_shown and now > taken_by:
                if call.attempts:
                    raise call.error(
                        502,
                        "worker_lost",
                        "The engine worker serving this request was lost and no other worker "
                        f"took it over within {self.settings.resume_timeout_s:g}s.",
                    )
                raise call.error(504, "timeout", "No engine worker started the request in time.")
            if queue.empty():
                # Arm a timer only when there is nothing to relay yet: while tokens flow, the
                # queue is rarely empty and a per-token timeout would be most of our cost.
                try:
                    async with asyncio.timeout(min(left, _LIVENESS_CHECK_S)):
                        item = await queue.get()
                except TimeoutError:
                    await self._watch.check(call, time.monotonic() - quiet_since)
                    continue
                quiet_since = time.monotonic()
            else:
                item = queue.get_nowait()
                quiet_since = now
            if item is TRANSPORT_DOWN:
                transport_down(call)
                continue
            call.transport_down_since = None
            if isinstance(item, protocol.Error):
                if item.code == "worker_lost" and call.shown:
                    raise WorkerLost(item.message)
                status, code = _ERRORS.get(item.code, (502, "engine_error"))
                raise call.error(status, code, item.message, retryable=item.code == "overloaded")
            if not isinstance(item, protocol.Delta):
                continue
            chunk = call.accept(item)
            if chunk is not None:
                yield chunk
                if call.finished:
                    return

    async def _cancel(self, request_id: str, entry: tuple[str, Any]) -> None:
        """Abort on the worker (if it has it) and unqueue it (if nobody has it yet)."""
        stream, entry_id = entry
        pipe = self._redis.pipeline(transaction=False)
        pipe.publish(
            redis_names.cancel_channel(self.model), protocol.encode(protocol.Cancel(request_id))
        )
        pipe.xdel(stream, entry_id)
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                await pipe.execute()
        except (RedisError, OSError, TimeoutError) as exc:
            logger.warning("could not cancel %s: %s", request_id, exc)

    def _on_served(self, call: EngineCall, hashes: list[int]) -> None:
        worker = call.worker_id or ""
        call.counted_on = worker
        self.workers.count(worker, 1)
        if hashes and worker:
            self._spawn(self.workers.remember_prefix(hashes, worker))

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        await self.kv_routing.aclose()
        await self._replies.aclose()
        if self._background:
            await asyncio.wait(self._background, timeout=2.0)
        if self._owns_client:
            await self._redis.aclose()
